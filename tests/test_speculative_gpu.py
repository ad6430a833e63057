"""Speculative decoding on the GPU (skips without CUDA): gpt-oss-20b shapes with random weights in
bf16, Triton kernels, CUDA graphs for decode steps and for verification steps.

Greedy with speculation must equal greedy without it. A verification step computes a token's
logits in a (k+1)-token extend step instead of a 1-token decode step, and bf16 rounds the two
differently, so where the plain run's top two choices are within rounding noise either token is
a correct greedy continuation, and after such a step the texts legitimately differ. As in
tests/test_gpu_engine.py, each sequence is compared token for token up to its first step whose
top-2 margin (in the plain run's own logits, logit bias included) is below `MARGIN`, and most
tokens must have been compared.

The output is confined to a few words by a logit bias so that n-grams recur (random weights do
not copy their prompt): both drafters then propose drafts that are partly kept, partly rejected.
One 20b model (about 14 GB) serves every engine here.
"""

from __future__ import annotations

import random

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

MARGIN = 0.25
WORDS = [1000 + 37 * i for i in range(6)]
BIAS = {w: 30.0 for w in WORDS}


@pytest.fixture(scope="module")
def model():
    from inference.config import ModelConfig
    from inference.model import GptOssModel
    from inference.tiny_checkpoint import hf_config_dict

    config = ModelConfig.from_dict(hf_config_dict(dict(
        num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, hidden_size=2880,
        intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        sliding_window=128, max_position_embeddings=131072)))
    model = GptOssModel.from_random(config, device="cuda", max_positions=2048)
    yield model
    del model
    torch.cuda.empty_cache()


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    block = [rng.choice(WORDS) for _ in range(40)]
    return [block * 4, [rng.choice(WORDS) for _ in range(150)], block * 2 + [rng.randrange(200_000) for _ in range(30)]]


def run(model, max_tokens: int, **spec) -> tuple[list[list[int]], object]:
    from inference.engine import EngineConfig, LLMEngine
    from inference.request import GenerationRequest, SamplingParams

    eng = LLMEngine(model, EngineConfig(num_pages=512, max_model_len=1024, max_num_seqs=4, **spec))
    assert eng.runner.graphs is not None
    for i, p in enumerate(prompts()):
        eng.add_request(GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    logit_bias=BIAS)))
    out = {str(i): [] for i in range(len(prompts()))}
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id].extend(d.token_ids)
    stats = eng.stats()
    assert eng.cache.full.num_used == 0
    del eng
    torch.cuda.empty_cache()
    return [out[str(i)] for i in range(len(prompts()))], stats


def margins(model, prompt: list[int], output: list[int]) -> list[float]:
    """Top-2 margin of the biased logits before each output token (one teacher-forced prefill)."""
    from inference.single_sequence import SingleSequenceCache

    cache = SingleSequenceCache(model, len(prompt) + len(output))
    logits = cache.forward(prompt + output[:-1])[len(prompt) - 1 :].clone()
    logits[:, torch.tensor(WORDS, device=logits.device)] += 30.0
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def compare(model, spec: list[list[int]], plain: list[list[int]]) -> tuple[int, int]:
    compared = total = 0
    for p, ours, ref in zip(prompts(), spec, plain):
        total += len(ref)
        for step, (a, b, m) in enumerate(zip(ours, ref, margins(model, p, ref))):
            assert a == b, f"step {step}: with drafts {a}, without {b} (margin {m:.3f})"
            compared += 1
            if m < MARGIN:
                break
    return compared, total


@pytest.fixture(scope="module")
def plain(model):
    return run(model, 48)[0]


def test_ngram_greedy_equals_plain_greedy_on_20b_shapes(model, plain):
    spec, stats = run(model, 48, speculative="ngram", num_draft_tokens=4)
    assert stats.spec_steps > 0 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    compared, total = compare(model, spec, plain)
    assert compared >= total // 2, f"only {compared} of {total} tokens were clear enough to compare"


def test_eagle3_greedy_equals_plain_greedy_on_20b_shapes(model, plain, tmp_path):
    from inference.eagle3 import write_random_eagle3_checkpoint

    # A random draft head whose vocabulary is the biased words: its guesses are sometimes right.
    draft = write_random_eagle3_checkpoint(tmp_path, model.config, draft_vocab_size=len(WORDS),
                                           draft_token_ids=WORDS, seed=2)
    spec, stats = run(model, 48, speculative="eagle3", draft_model=str(draft), num_draft_tokens=3)
    assert stats.spec_steps > 0 and stats.spec_draft_tokens > 0
    compared, total = compare(model, spec, plain)
    assert compared >= total // 2, f"only {compared} of {total} tokens were clear enough to compare"
