"""The arithmetic and the step shapes of `benchmarks/bench_engine.py` that need no GPU: a decode
step's roofline at any batch, and the mixed step its `--profile ... --mixed-prompt` times."""

from __future__ import annotations

import sys

import pytest
import torch

import tests.triton_interpreter  # noqa: F401  (first: sets TRITON_INTERPRET on CPU)
from inference.config import GPT_OSS_SHAPES, ModelConfig
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import hf_config_dict
from tests.benchmark_scripts import BENCHMARKS, load_benchmark

sys.path.insert(0, str(BENCHMARKS))  # the script imports its sibling modules
bench_engine = load_benchmark("bench_engine")


def shapes(name: str) -> ModelConfig:
    return ModelConfig.from_dict(hf_config_dict(GPT_OSS_SHAPES[name]))


@pytest.mark.parametrize("name", ["20b", "120b"])
def test_step_roofline_at_batch_1_is_the_bytes_a_token_reads(name):
    c = shapes(name)
    one = bench_engine.step_roofline(c, 1, 1024)
    assert one["bytes"] == pytest.approx(sum(bench_engine.bytes_per_token(c, 1024).values()))
    # The whole model's experts once every expert is touched, plus each sequence's KV.
    big = bench_engine.step_roofline(c, 4096, 1024)
    parts = bench_engine.bytes_per_token(c, 1024)
    router = 2 * c.num_local_experts * (c.hidden_size + 1)
    per_expert = (parts["experts"] / c.num_hidden_layers - router) / c.num_experts_per_tok
    dense = parts["attention"] + parts["lm_head"] + c.num_hidden_layers * router
    every_expert = c.num_hidden_layers * c.num_local_experts * per_expert
    assert big["bytes"] == pytest.approx(dense + every_expert + 4096 * parts["kv"], rel=1e-6)
    # FLOPs grow with the batch; bytes less than proportionally.
    assert big["flops"] == pytest.approx(4096 * one["flops"])
    assert bench_engine.step_roofline(c, 256, 1024)["bytes"] < 256 * one["bytes"]


def test_roofline_binds_on_memory_at_decode_batches_and_on_compute_past_them():
    c = shapes("20b")
    rate, bound = bench_engine.roofline_tok_s(c, 256, 1024, bandwidth=4.28e12, flop_rate=800e12)
    assert bound == "memory" and 256 / rate == pytest.approx(
        bench_engine.step_roofline(c, 256, 1024)["bytes"] / 4.28e12
    )
    assert bench_engine.roofline_tok_s(c, 16384, 128, bandwidth=4.28e12, flop_rate=800e12)[1] == "compute"


def test_mixed_step_decodes_the_batch_as_its_decode_step_does():
    """The decode rows of a step with a prompt joining them compute what the decode step alone
    does (same caches, same positions); the prompt lands on pages of its own."""
    c = ModelConfig.from_dict(hf_config_dict())
    model = GptOssModel.from_random(c, device="cpu", max_positions=256, seed=1)
    page, pages_per_seq, batch, prompt = 16, 4, 3, 30
    g = torch.Generator().manual_seed(0)
    shape = (batch * pages_per_seq + 2, page, c.num_key_value_heads, c.head_dim)
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(c.num_hidden_layers)]
    alone = bench_engine.StaticBatch(model, caches, batch, 20, pages_per_seq, page)
    mixed = bench_engine.StaticBatch(model, [(k.clone(), v.clone()) for k, v in caches], batch, 20, pages_per_seq, page)
    mixed.ids = alone.ids
    expected = model(alone.ids, alone.metadata(), caches)
    ids, meta = bench_engine.mixed_step(mixed, prompt)
    assert meta.q_lens == [1] * batch + [prompt] and meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 3 + prompt]
    assert meta.slot_mapping["full"][batch:].tolist() == list(
        range(batch * pages_per_seq * page, batch * pages_per_seq * page + prompt)
    )
    got = model(ids, meta, [(k.clone(), v.clone()) for k, v in caches])
    torch.testing.assert_close(got[:batch], expected, rtol=2e-4, atol=2e-4)
