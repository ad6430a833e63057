"""Tensor parallelism on 2 and 4 GPUs (Triton kernels, CUDA-graph decode, small all-reduces over
peer memory, NCCL for the rest), against 1 GPU. Skips without the GPUs; the CPU tests
(`test_tensor_parallel.py`, gloo) cover the logic.

* float32, tiny model: greedy tokens of the 2- and 4-GPU engines (the MoE split by expert
  columns, and on 4 by whole experts) must equal the 1-GPU engine's, token for token, up to a
  sequence's first step whose 1-GPU top-2 margin is a near tie (below 0.01 logits); the greedy
  steps without logprobs (vocabulary-parallel argmax) the same as far as both run.
* bfloat16, gpt-oss-20b shapes, random weights (the same seed: the same model, with decisive
  routers, see `inference.model.gpt_oss.random_tensor_source`): the whole prefill logits agree (relative
  L2 error), greedy tokens agree up to near ties, and every 2-GPU choice is within a stated
  tolerance of the 1-GPU engine's best logit when it scores the same tokens.

Both engines live in this process at once (explicit num_pages, so neither sizes its cache from
free memory); the 2-GPU one spawns one worker for cuda:1.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu_comparison import choice_gaps, compare_greedy, greedy, prompts

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def all_logits(engine, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] of a fresh sequence, every row (through every rank)."""
    from inference.runner.model_runner import StepPlan
    from inference.scheduling.kv_cache import PageTable

    table = PageTable()
    engine.cache.reserve(table, 0, len(tokens))
    try:
        plan = StepPlan(
            tokens,
            [table.full],
            [table.sliding] if engine.runner.has_sliding else None,
            [0],
            [len(tokens)],
            list(range(len(tokens))),
        )
        return engine.runner.forward_step(plan)[0].float().cpu()
    finally:
        engine.cache.release(table)


@pytest.mark.parametrize(
    "size,moe_parallel",
    [
        pytest.param(2, "tensor", marks=pytest.mark.gpu(count=2)),
        pytest.param(4, "tensor", marks=pytest.mark.gpu(count=4)),
        pytest.param(4, "expert", marks=pytest.mark.gpu(count=4)),
    ],
)
def test_tiny_model_float32_n_gpus_equal_one(tmp_path, size, moe_parallel):
    from inference.engine.core import LLMEngine
    from inference.model.tiny_checkpoint import write_tiny_checkpoint
    from inference.request import GenerationRequest, SamplingParams
    from tests.engine_runs import drain, tokens_of

    shapes = dict(intermediate_size=96) if size == 2 else dict(intermediate_size=160, num_key_value_heads=4)
    path = write_tiny_checkpoint(tmp_path / "tiny", seed=0, **shapes)  # uneven expert-column splits
    batch = prompts(6, 150)
    options = dict(device="cuda", dtype=torch.float32, num_pages=512, page_size=16, max_num_batched_tokens=8)
    one = LLMEngine.from_pretrained(path, **options)
    many = LLMEngine.from_pretrained(path, tensor_parallel_size=size, moe_parallel=moe_parallel, **options)
    try:
        assert many.runner.graphs is not None and many.model.attention_backend.name in ("triton", "flashinfer")
        assert many.model.tp.mode == "peer", many.model.tp.peer_unavailable  # small all-reduces over peer memory
        assert many.kv_caches[0][0].shape[2] == 1  # one KV head a rank
        reference = greedy(one, batch, 40)
        compared, total = compare_greedy(reference, greedy(many, batch, 40), near_tie=0.01)
        print(f"float32 tiny, {size} GPUs ({moe_parallel}): {compared} of {total} greedy tokens compared, all equal")
        # Not a vacuous comparison: a third of the tokens before any near tie. 2 GPUs against 1
        # compared 115 of 240 on 2 H200s (2026-11-24); the 1-GPU engine against the CPU, 161.
        assert compared >= total // 3
        # Greedy without logprobs: the vocabulary-parallel argmax, no gathered logits.
        for i, p in enumerate(batch):
            many.add_request(GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=40)))
        plain = [tokens_of(ds) for _, ds in sorted(drain(many).items(), key=lambda kv: int(kv[0]))]
        for i, ((ref_tokens, _, margins), tokens) in enumerate(zip(reference, plain)):
            upto = next((k for k, m in enumerate(margins) if m < 0.01), len(margins))
            assert tokens[:upto] == ref_tokens[:upto], f"sequence {i}"
    finally:
        many.close()


@pytest.mark.gpu(count=2)
def test_full_size_random_20b_two_gpus_match_one():
    from inference.config import GPT_OSS_SHAPES, EngineConfig, ModelConfig
    from inference.engine.core import LLMEngine
    from inference.engine.executor import ModelSource, start_tensor_parallel
    from inference.model.tiny_checkpoint import hf_config_dict

    config = ModelConfig.from_dict(hf_config_dict(GPT_OSS_SHAPES["20b"]))
    source = ModelSource(random_config=config, seed=0, decisive_routing=True)  # see random_tensor_source
    batch = prompts(4, 200, seed=1)
    options = dict(num_pages=512, max_model_len=1024, max_num_seqs=8)
    one = start_tensor_parallel(source, EngineConfig(**options), LLMEngine, device="cuda")
    two = start_tensor_parallel(source, EngineConfig(tensor_parallel_size=2, **options), LLMEngine, device="cuda")
    try:
        assert one.runner.graphs is not None and two.runner.graphs is not None
        ref_logits, our_logits = all_logits(one, batch[0]), all_logits(two, batch[0])
        rel = ((our_logits - ref_logits).norm() / ref_logits.norm()).item()

        reference, ours = greedy(one, batch, 24), greedy(two, batch, 24)
        compared, total = compare_greedy(reference, ours, near_tie=0.25)
        equal = sum(r[0] == o[0] for r, o in zip(reference, ours))
        # Teacher-forced: the 1-GPU engine scores the 2-GPU tokens; each must be (near) its best.
        gap, _ = choice_gaps(lambda tokens: all_logits(one, tokens), batch, ours)
        print(
            f"20b bf16, 2 GPUs vs 1: prefill logits relative error {rel:.4f}; {equal} of {len(batch)} greedy "
            f"sequences identical, {compared} of {total} tokens compared before a near tie; choice gap max "
            f"{gap.max():.4f} mean {gap.mean():.4f}"
        )
        assert rel < 0.1  # 1 GPU bf16 vs the float32 reference measured 0.033 on an H200 (test_gpu_engine)
        # Among 201k random logits, near ties (< 0.25) come every few tokens, so how many tokens
        # compare_greedy reached says little; the teacher-forced gaps are the measure.
        assert gap.max() < 0.5
    finally:
        two.close()
