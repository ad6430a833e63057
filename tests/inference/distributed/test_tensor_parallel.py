"""Tensor parallelism on CPU: two ranks (this process and one spawned worker) over gloo.

The tiny model is reshaped so every split is exercised: 4 attention heads and 2 KV heads (2 and 1
per rank), intermediate_size 96 = 3 MXFP4 blocks (rank 0 holds 2, rank 1 holds 1: an uneven
split), vocab 1001 (rank 1's lm_head shard is padded with a zero row). The single-device engine
on the same checkpoint is the oracle: logits must agree to float32 rounding (the split only
reorders sums) and greedy generation token for token.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from inference.config import ModelConfig
from inference.engine.async_engine import AsyncEngine
from inference.engine.core import LLMEngine
from inference.scheduling.kv_cache import PageTable
from inference.model.gpt_oss import GptOssModel
from inference.runner.model_runner import StepPlan
from inference.request import GenerationRequest, SamplingParams
from inference.distributed.group import TensorParallelGroup
from inference.distributed.sharding import TensorParallelError, check_tensor_parallel_size, shard_layout, valid_sizes
from inference.model.tiny_checkpoint import hf_config_dict, write_tiny_checkpoint
from tests.engine_runs import drain, tokens_of

SHAPES = dict(intermediate_size=96, vocab_size=1001)
OPTIONS = dict(device="cpu", page_size=4, num_pages=96, max_num_batched_tokens=16, max_model_len=256)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"), seed=3, **SHAPES)


@pytest.fixture(scope="module")
def shared_engines():
    built: dict[str, LLMEngine] = {}
    yield built
    if "split" in built:
        built["split"].close()


@pytest.fixture
def engines(checkpoint, shared_engines):
    """(single-device engine, 2-rank engine) on the checkpoint, built once per module (the split
    one again if a test shut it down: one process holds one tensor-parallel group at a time)."""
    if "single" not in shared_engines:
        shared_engines["single"] = LLMEngine.from_pretrained(checkpoint, **OPTIONS)
    if "split" not in shared_engines or shared_engines["split"].runner.workers is None:
        shared_engines["split"] = LLMEngine.from_pretrained(checkpoint, tensor_parallel_size=2, **OPTIONS)
    return shared_engines["single"], shared_engines["split"]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(SHAPES["vocab_size"]) for _ in range(length)]


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


# ----------------------------------------------------------------------------- the sharding


def test_bad_sizes_are_refused_with_the_field_and_the_sizes_that_work(checkpoint):
    tiny = ModelConfig.from_file(checkpoint)  # 4 heads, 2 KV heads, 3 expert blocks
    assert valid_sizes(tiny) == [1, 2]
    with pytest.raises(TensorParallelError, match=r"'num_attention_heads' \(4\).*work for this model: 1, 2$"):
        check_tensor_parallel_size(tiny, 3)
    with pytest.raises(TensorParallelError, match=r"'num_key_value_heads' \(2\)"):
        check_tensor_parallel_size(tiny, 4)
    one_block = ModelConfig.from_dict(hf_config_dict({"intermediate_size": 32}))
    with pytest.raises(TensorParallelError, match=r"'intermediate_size' \(32, 1 MXFP4 blocks of 32 values\)"):
        check_tensor_parallel_size(one_block, 2)
    # Through the engine: refused before any worker process starts.
    before = set(multiprocessing.active_children())
    with pytest.raises(TensorParallelError, match="num_key_value_heads"):
        LLMEngine.from_pretrained(checkpoint, tensor_parallel_size=4, **OPTIONS)
    assert set(multiprocessing.active_children()) == before


def test_gpt_oss_splits_over_2_4_8_gpus_in_whole_mxfp4_blocks():
    real = ModelConfig()  # gpt-oss: 64 heads, 8 KV heads, intermediate 2880 = 90 blocks
    assert valid_sizes(real) == [1, 2, 4, 8]
    for size in (2, 4, 8):
        layouts = [shard_layout(real, r, size) for r in range(size)]
        spans = [lay.intermediate for lay in layouts]
        assert spans[0][0] == 0 and spans[-1][1] == 2880
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
        widths = [stop - start for start, stop in spans]
        assert all(w % 32 == 0 for w in widths) and max(widths) - min(widths) <= 32
        assert [lay.kv_heads for lay in layouts] == [(r * 8 // size, (r + 1) * 8 // size) for r in range(size)]
    assert [lay.intermediate for lay in (shard_layout(real, r, 4) for r in range(4))] == [
        (0, 736), (736, 1472), (1472, 2176), (2176, 2880)]


def test_each_rank_reads_and_holds_only_its_shard(checkpoint, engines):
    config = ModelConfig.from_file(checkpoint)
    full = GptOssModel.from_pretrained(checkpoint, device="cpu")
    ranks = []
    for rank in range(2):
        group = TensorParallelGroup(shard_layout(config, rank, 2), "cpu")  # no collectives: load only
        ranks.append((group, GptOssModel.from_pretrained(checkpoint, device="cpu", tensor_parallel=group)))
    (g0, m0), (g1, m1) = ranks
    d = 16  # head_dim; the fused qkv rows are q [0, 64), k [64, 96), v [96, 128)
    # Attention: rank 1 holds q heads 2-3, KV head 1, their sinks and o_proj columns.
    a, a1 = full.layers[1].attn, m1.layers[1].attn
    want_rows = torch.cat([torch.arange(32, 64), torch.arange(80, 96), torch.arange(112, 128)])
    assert a1.qkv.weight.shape == (64, 64) and torch.equal(a1.qkv.weight, a.qkv.weight[want_rows])
    assert torch.equal(a1.qkv.bias, a.qkv.bias[want_rows])
    assert torch.equal(a1.sinks, a.sinks[2:]) and a1.num_heads == 2 and a1.num_kv_heads == 1
    assert torch.equal(a1.o_proj.weight, a.o_proj.weight[:, 2 * d:])
    # Biases after a reduction are added once: rank 0 has them, rank 1 zeros.
    assert torch.equal(m0.layers[1].attn.o_proj.bias, a.o_proj.bias) and not a1.o_proj.bias.any()
    # Experts: 3 blocks of 32 -> rank 0 columns 0-63, rank 1 columns 64-95 (gate/up rows 128-191).
    ex, ex0, ex1 = (m.layers[0].mlp.weights.experts for m in (full, m0, m1))
    assert ex0.gate_up_blocks.shape == (4, 128, 2, 16) and ex1.gate_up_blocks.shape == (4, 64, 2, 16)
    assert torch.equal(ex1.gate_up_blocks, ex.gate_up_blocks[:, 128:])
    assert torch.equal(ex1.gate_up_bias, ex.gate_up_bias[:, 128:])
    assert ex0.down_blocks.shape == (4, 64, 2, 16) and ex1.down_blocks.shape == (4, 64, 1, 16)
    assert torch.equal(ex1.down_blocks, ex.down_blocks[:, :, 2:])
    assert torch.equal(ex1.down_scales, ex.down_scales[:, :, 2:])
    assert torch.equal(ex0.down_bias, ex.down_bias) and not ex1.down_bias.any()
    assert torch.equal(m1.layers[0].mlp.weights.router_weight, full.layers[0].mlp.weights.router_weight)
    # lm_head: 501 rows each, rank 1's last one padding.
    assert m1.lm_head.weight.shape == (501, 64) and torch.equal(m1.lm_head.weight[:500], full.lm_head.weight[501:])
    assert not m1.lm_head.weight[500].any()
    assert torch.equal(m1.embed.weight, full.embed.weight)

    # Bytes read: the sharded tensors exactly partitioned, the replicated ones read by both.
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    nbytes = {name: (1 if "blocks" in name or "scales" in name else 2) * torch.Size(shape).numel()
              for name, shape in sizes.items()}
    replicated = sum(n for name, n in nbytes.items() if "norm" in name or "embed" in name or "router" in name)
    assert g0.bytes_read + g1.bytes_read == sum(nbytes.values()) + replicated
    assert max(g0.bytes_read, g1.bytes_read) < 0.8 * sum(nbytes.values())
    # The running engine's worker read what rank 1 reads here.
    _, split = engines
    assert split.runner.workers.bytes_read == [g0.bytes_read, g1.bytes_read]
    assert split.model.layers[0].attn.num_heads == 2 and split.kv_caches[0][0].shape[2] == 1


def test_random_weights_shard_like_the_whole_model(checkpoint):
    """Benchmarks split random-weight models: each rank's shard must be the same model's slice."""
    config = ModelConfig.from_file(checkpoint)
    full = GptOssModel.from_random(config, device="cpu", seed=5)
    group = TensorParallelGroup(shard_layout(config, 1, 2), "cpu")
    part = GptOssModel.from_random(config, device="cpu", seed=5, tensor_parallel=group)
    want_rows = torch.cat([torch.arange(32, 64), torch.arange(80, 96), torch.arange(112, 128)])
    assert torch.equal(part.layers[0].attn.qkv.weight, full.layers[0].attn.qkv.weight[want_rows])
    ex, ex1 = full.layers[1].mlp.weights.experts, part.layers[1].mlp.weights.experts
    assert torch.equal(ex1.down_blocks, ex.down_blocks[:, :, 2:])
    assert torch.equal(ex1.gate_up_scales, ex.gate_up_scales[:, 128:])
    assert torch.equal(part.lm_head.weight[:500], full.lm_head.weight[501:])
    assert torch.equal(part.layers[1].mlp.weights.router_weight, full.layers[1].mlp.weights.router_weight)


# ----------------------------------------------------------------------------- running split


def run_plans(engine: LLMEngine, plans: list[StepPlan]) -> list[torch.Tensor]:
    return [engine.runner.forward_step(plan)[0] for plan in plans]


def test_logits_equal_single_device_for_prefill_and_decode(engines):
    single, split = engines
    assert single.model.tp is None and single.runner.workers is None  # TP 1: no collectives at all
    a, b = prompt(1, 13), prompt(2, 7)  # longer than the sliding window (8), across pages of 4
    results = []
    for engine in (single, split):
        ta, tb = PageTable(), PageTable()
        engine.cache.reserve(ta, 0, 24)
        engine.cache.reserve(tb, 0, 24)
        tables = lambda *ts: ([t.full for t in ts], [t.sliding for t in ts])  # noqa: E731
        plans = [StepPlan(a, *tables(ta), [0], [13], list(range(13)))]  # prefill, every row's logits
        for i in range(3):  # decode
            plans.append(StepPlan([a[i]], *tables(ta), [13 + i], [1], [0]))
        # A mixed step: b's prefill chunk beside a's decode.
        plans.append(StepPlan(b + [a[5]], *tables(tb, ta), [0, 16], [7, 1], [6, 7]))
        results.append(run_plans(engine, plans))
        engine.cache.release(ta)
        engine.cache.release(tb)
    for want, got in zip(*results):
        assert got.shape == want.shape and got.shape[-1] == 1001
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert results[0][0].std() > 0.1  # not trivially equal


def tokens_and_logprobs(engine: LLMEngine) -> dict[str, tuple[list[int], list]]:
    """Run to the end; per request, its tokens and their logprobs."""
    return {rid: (tokens_of(ds), [lp for d in ds for lp in d.logprobs or []]) for rid, ds in drain(engine).items()}


def test_greedy_generation_equals_single_device(engines):
    single, split = engines
    outputs = []
    for engine in (single, split):
        for i, n in enumerate([3, 9, 14, 21, 30]):  # 21 and 30 prefill in chunks beside decodes
            engine.add_request(GenerationRequest(str(i), prompt(10 + i, n),
                                                 SamplingParams(temperature=0, max_tokens=12, logprobs=3)))
        engine.add_request(GenerationRequest("sampled", prompt(20, 11),
                                             SamplingParams(temperature=1.0, seed=7, max_tokens=12)))
        outputs.append(tokens_and_logprobs(engine))
    want, got = outputs
    assert set(got) == set(want) and all(len(tokens) == 12 for tokens, _ in got.values())
    for rid in want:
        assert got[rid][0] == want[rid][0], f"request {rid}"
    for rid in map(str, range(5)):
        for w, g in zip(want[rid][1], got[rid][1]):
            assert abs(w.logprob - g.logprob) < 1e-4 and [t for t, _ in w.top] == [t for t, _ in g.top]
    assert split.cache.full.num_used == 0


# ----------------------------------------------------------------------------- processes


async def test_async_engine_shutdown_stops_the_workers(engines):
    engine = AsyncEngine(engines[1])
    workers = engine.engine.runner.workers
    pids = workers.pids
    assert len(pids) == 1 and alive(pids[0])
    deltas = [d async for d in engine.generate(GenerationRequest("r", prompt(5, 6),
                                                                 SamplingParams(temperature=0, max_tokens=4)))]
    assert sum(len(d.token_ids) for d in deltas) == 4
    await engine.shutdown()
    assert not any(alive(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
    assert not torch.distributed.is_initialized()  # rank 0 left the group too


def test_workers_exit_when_rank_0_is_killed(checkpoint, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from inference.engine.core import LLMEngine

        if __name__ == "__main__":
            engine = LLMEngine.from_pretrained({str(checkpoint)!r}, tensor_parallel_size=2, **{OPTIONS!r})
            print(*engine.runner.workers.pids, flush=True)
            time.sleep(120)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip(), f"rank 0 did not start (exit code {proc.poll()})"
        pids = [int(p) for p in line.split()]
        assert all(alive(pid) for pid in pids)
        proc.send_signal(signal.SIGKILL)  # no cleanup code runs in rank 0
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids), "a worker outlived rank 0"
    finally:
        proc.kill()
        proc.wait()


def test_serve_flag_reaches_the_engine_config():
    import argparse

    from agent_server.cli.serve import add_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_options(parser.parse_args(["--tensor-parallel-size", "2"]))["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in engine_options(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tensor-parallel-size", "0"])


async def test_a_dead_worker_fails_the_engine_where_the_server_sees_it(checkpoint, tmp_path):
    """A worker that exits leaves an engine that can run no step: every request would fail. The
    engine says so (`failure`, what /health and /ready report), new requests are refused, and in
    an engine process the process stops, so its streams end and the server sees it gone."""
    from inference.engine.process import EngineProcess, EngineSpec
    from tests.engine_runs import collect

    engine = AsyncEngine(LLMEngine.from_pretrained(checkpoint, tensor_parallel_size=2, **OPTIONS))
    try:
        assert engine.failure is None
        os.kill(engine.engine.runner.workers.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 1" in (engine.failure or "")
        with pytest.raises(RuntimeError, match="rank 1"):
            engine.generate(GenerationRequest("r", prompt(5, 6), SamplingParams(temperature=0, max_tokens=4)))
    finally:
        await engine.shutdown()
    assert engine.failure is None  # shut down on purpose

    process = EngineProcess(EngineSpec(model_dir=str(checkpoint), options={**OPTIONS, "tensor_parallel_size": 2}))
    try:
        first = await collect(process.generate(GenerationRequest("a", prompt(6, 6),
                                                                 SamplingParams(temperature=0, max_tokens=3))))
        assert first[-1].finish_reason == "length"
        worker = [p for p in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
        os.kill(int(worker[0]), signal.SIGKILL)
        time.sleep(0.5)
        last = await asyncio.wait_for(collect(process.generate(GenerationRequest(
            "b", prompt(7, 6), SamplingParams(temperature=0, max_tokens=3)))), 60)
        assert last[-1].finish_reason == "error"
        deadline = time.monotonic() + 30
        while process.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "rank 1" in (process.failure or "")
    finally:
        await process.shutdown()
