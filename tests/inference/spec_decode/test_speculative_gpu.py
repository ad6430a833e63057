"""Speculative decoding on the GPU (skips without CUDA): gpt-oss-20b shapes, random weights.

Greedy with speculation must equal greedy without it. Two settings, one 20b model at a time:

* float32 with the pure-torch reference backends: the same prefix gives bit-identical logits
  whether its last token runs in a prefill, a (k+1)-token verification step or a decode step,
  so the outputs must agree exactly, token for token, with either drafter.
* bf16 with the Triton kernels and CUDA graphs for decode and verification steps (how the
  engine serves). A verification step rounds differently from a decode step, so where the plain
  run's top two choices are within rounding noise either token is a correct greedy continuation
  and after such a step the texts legitimately differ. So each text must equal the plain one up
  to their first difference, that difference (if any) must sit where the plain run's top-2
  margin (logit bias included, from a teacher-forced pass) is below `MARGIN`, and most tokens
  must have been compared. Random routers put many experts' scores within rounding of each
  other, and bf16 then routes the same token to different experts on different code paths
  (measured on an H200: the same 200-token prefix's last logits differed by up to 4, logits of
  std 1, between a prefill and a decode step, also with the pure-torch backends in bf16, and not
  at all in float32). That would make every comparison a coin toss, so here each layer's router
  gets a clear preference (`from_random(decisive_routing=True)`: a bias on four experts), which
  leaves the kernels' rounding as the only difference.

The output is confined to a few words by a logit bias so that n-grams recur (random weights do
not copy their prompt): both drafters then propose drafts that are partly kept, partly rejected.
"""

from __future__ import annotations

import random

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.gpu

MARGIN = 0.25
WORDS = [1000 + 37 * i for i in range(6)]
BIAS = {w: 30.0 for w in WORDS}


def build_20b(**options):
    from inference.config import GPT_OSS_SHAPES, ModelConfig
    from inference.model.gpt_oss import GptOssModel
    from inference.model.tiny_checkpoint import hf_config_dict

    config = ModelConfig.from_dict(hf_config_dict(GPT_OSS_SHAPES["20b"]))
    return GptOssModel.from_random(config, device="cuda", max_positions=2048, **options)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    block = [rng.choice(WORDS) for _ in range(40)]
    return [block * 4, [rng.choice(WORDS) for _ in range(150)], block * 2 + [rng.randrange(200_000) for _ in range(30)]]


def run(model, max_tokens: int, **options) -> tuple[list[list[int]], object]:
    from inference.config import EngineConfig
    from inference.engine.core import LLMEngine
    from inference.request import GenerationRequest, SamplingParams

    eng = LLMEngine(model, EngineConfig(num_pages=512, max_model_len=1024, max_num_seqs=4, **options))
    for i, p in enumerate(prompts()):
        eng.add_request(
            GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=BIAS))
        )
    out = {str(i): [] for i in range(len(prompts()))}
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id].extend(d.token_ids)
    stats = eng.stats()
    assert eng.cache.full.num_used == 0 and eng.cache.sliding.num_used == 0
    del eng
    torch.cuda.empty_cache()
    return [out[str(i)] for i in range(len(prompts()))], stats


def eagle3_draft(model, path) -> str:
    """A random draft head whose vocabulary is the biased words: its guesses are sometimes right."""
    from inference.spec_decode.eagle3 import write_random_eagle3_checkpoint

    return str(
        write_random_eagle3_checkpoint(path, model.config, draft_vocab_size=len(WORDS), draft_token_ids=WORDS, seed=2)
    )


def assert_drafts_were_verified(stats, kept: bool = True) -> None:
    assert stats.spec_steps > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens
    if kept:
        assert stats.spec_accepted_tokens > 0


# Class-scoped: each class's 20b model is freed before the next class builds its own.
@pytest.fixture(scope="class")
def f32_model():
    model = build_20b(dtype=torch.float32, attention_backend="reference", moe_backend="reference")
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="class")
def f32_plain(f32_model):
    return run(f32_model, 32, enforce_eager=True)[0]


class TestFloat32ReferenceBackends:
    def test_ngram_greedy_equals_plain_greedy_exactly(self, f32_model, f32_plain):
        spec, stats = run(f32_model, 32, enforce_eager=True, speculative="ngram", num_draft_tokens=4)
        assert_drafts_were_verified(stats)
        assert spec == f32_plain

    def test_eagle3_greedy_equals_plain_greedy_exactly(self, f32_model, f32_plain, tmp_path):
        spec, stats = run(
            f32_model,
            32,
            enforce_eager=True,
            speculative="eagle3",
            num_draft_tokens=3,
            draft_model=eagle3_draft(f32_model, tmp_path),
        )
        assert_drafts_were_verified(stats, kept=False)
        assert spec == f32_plain


@pytest.fixture(scope="class")
def bf16_model():
    model = build_20b(decisive_routing=True)
    assert model.attention_backend.name in ("triton", "flashinfer")  # the Triton kernels at decode either way
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="class")
def bf16_plain(bf16_model):
    return run(bf16_model, 48)[0]


class TestTritonBf16WithCudaGraphs:
    def margins(self, model, prompt: list[int], output: list[int]) -> list[float]:
        """Top-2 margin of the biased logits before each output token (one teacher-forced prefill)."""
        from inference.runner.single_sequence import SingleSequenceCache

        cache = SingleSequenceCache(model, len(prompt) + len(output))
        logits = cache.forward(prompt + output[:-1])[len(prompt) - 1 :].clone()
        logits[:, torch.tensor(WORDS, device=logits.device)] += 30.0
        top = logits.topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]).tolist()

    def compare(self, model, spec: list[list[int]], plain: list[list[int]]) -> None:
        compared = total = 0
        for p, ours, ref in zip(prompts(), spec, plain):
            total += len(ref)
            same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
            if same < len(ref):
                m = self.margins(model, p, ref)[same]
                assert m < MARGIN, f"step {same}: with drafts {ours[same]}, without {ref[same]} (margin {m:.3f})"
            compared += same
        assert compared >= total // 2, f"only {compared} of {total} tokens agree before a near tie"

    def test_ngram_greedy_equals_plain_greedy(self, bf16_model, bf16_plain):
        spec, stats = run(bf16_model, 48, speculative="ngram", num_draft_tokens=4)
        assert_drafts_were_verified(stats)
        self.compare(bf16_model, spec, bf16_plain)

    def test_eagle3_greedy_equals_plain_greedy(self, bf16_model, bf16_plain, tmp_path):
        spec, stats = run(
            bf16_model, 48, speculative="eagle3", num_draft_tokens=3, draft_model=eagle3_draft(bf16_model, tmp_path)
        )
        assert_drafts_were_verified(stats, kept=False)
        self.compare(bf16_model, spec, bf16_plain)
