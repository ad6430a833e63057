"""Tensor parallelism on CPU: two ranks (this process and one spawned worker) over gloo, and four.

The tiny model is reshaped so every split is exercised: 4 attention heads and 2 KV heads (2 and 1
per rank), intermediate_size 96 = 3 MXFP4 blocks (rank 0 holds 2, rank 1 holds 1: an uneven
split), vocab 1001 (rank 1's lm_head shard is padded with a zero row). A second checkpoint with 4
KV heads and 4 blocks splits over 4 ranks (vocab 1001: 251 a rank, 3 padding rows on the last),
by expert columns and by whole experts (expert parallelism). The single-device engine on the same
checkpoint is the oracle: logits must agree to float32 rounding (the split only reorders sums)
and greedy generation token for token, through the vocabulary-parallel argmax (greedy steps) and
the gathered logits (steps with logprobs) alike. A worker that stops (SIGSTOP) fails the engine
within seconds, naming the rank.
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
from inference.distributed.group import TensorParallelGroup
from inference.distributed.sharding import TensorParallelError, check_tensor_parallel_size, shard_layout, valid_sizes
from inference.engine.async_engine import AsyncEngine
from inference.engine.core import LLMEngine
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import hf_config_dict, write_tiny_checkpoint
from inference.request import GenerationRequest, SamplingParams
from inference.runner.model_runner import StepPlan
from inference.runner.vocab_parallel import vocab_parallel_argmax
from inference.scheduling.kv_cache import PageTable
from tests.engine_runs import drain, tokens_of

SHAPES = dict(intermediate_size=96, vocab_size=1001)
SHAPES4 = dict(intermediate_size=128, vocab_size=1001, num_key_value_heads=4)  # splits over 4 ranks
OPTIONS = dict(device="cpu", page_size=4, num_pages=96, max_num_batched_tokens=16, max_model_len=256)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"), seed=3, **SHAPES)


@pytest.fixture(scope="module")
def checkpoint4(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp4"), seed=5, **SHAPES4)


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
        (0, 736),
        (736, 1472),
        (1472, 2176),
        (2176, 2880),
    ]


@pytest.mark.slow
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
    assert torch.equal(a1.o_proj.weight, a.o_proj.weight[:, 2 * d :])
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
    nbytes = {
        name: (1 if "blocks" in name or "scales" in name else 2) * torch.Size(shape).numel()
        for name, shape in sizes.items()
    }
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


def test_expert_parallelism_splits_whole_experts():
    real = ModelConfig()  # 120b-like: 32 experts here (the 20b's), 8 KV heads
    assert valid_sizes(real, moe_parallel="expert") == [1, 2, 4, 8]
    layouts = [shard_layout(real, r, 4, "expert") for r in range(4)]
    assert [lay.experts for lay in layouts] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert all(lay.intermediate == (0, 2880) for lay in layouts)  # every column of its experts
    assert shard_layout(real, 1, 4).experts == (0, 32)  # tensor parallelism: all experts, a slice each
    six = ModelConfig.from_dict(
        hf_config_dict({"num_local_experts": 6, "num_attention_heads": 4, "num_key_value_heads": 4})
    )
    with pytest.raises(TensorParallelError, match=r"'num_local_experts' \(6\).*work for this model: 1, 2$"):
        check_tensor_parallel_size(six, 4, "expert")
    with pytest.raises(TensorParallelError, match="moe_parallel"):
        check_tensor_parallel_size(six, 2, "pipeline")


def test_an_expert_parallel_rank_holds_whole_experts(checkpoint):
    config = ModelConfig.from_file(checkpoint)  # 4 experts: 2 a rank
    full = GptOssModel.from_pretrained(checkpoint, device="cpu")
    group = TensorParallelGroup(shard_layout(config, 1, 2, "expert"), "cpu")
    part = GptOssModel.from_pretrained(checkpoint, device="cpu", tensor_parallel=group)
    ex, ex1 = full.layers[0].mlp.weights.experts, part.layers[0].mlp.weights.experts
    assert part.layers[0].mlp.weights.expert_offset == 2
    for name in ("gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks", "down_scales", "down_bias"):
        assert torch.equal(getattr(ex1, name), getattr(ex, name)[2:4]), name  # biases too: each expert's own
    assert torch.equal(part.layers[0].mlp.weights.router_weight, full.layers[0].mlp.weights.router_weight)
    assert part.layers[0].attn.num_heads == 2  # attention still split by heads


def test_vocab_parallel_argmax_is_the_argmax_of_the_whole_row():
    """Each rank's best of its vocabulary slice, combined: the first index of the row's maximum,
    whatever slice it is in. Rows: random; every logit negative (the last rank's zero padding
    columns must not win); a tie across ranks (the lower id wins); a tie inside one rank; NaN
    (read as +inf, as the sampler's argmax does)."""
    config = ModelConfig.from_dict(hf_config_dict(SHAPES4))
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 1001, generator=g)
    rows[1] = -rows[1].abs() - 1
    rows[2, 100] = rows[2, 700] = 50.0
    rows[3, 260] = rows[3, 300] = 50.0
    rows[4, 800] = float("nan")
    want = [int(rows[i].nan_to_num(nan=float("inf")).argmax()) for i in range(6)]
    want[2], want[3] = 100, 260
    for size in (2, 4):
        layouts = [shard_layout(config, r, size) for r in range(size)]
        sent = []
        groups = []
        for lay in layouts:  # each rank's step up to its all-reduce
            tp = TensorParallelGroup(lay, "cpu")
            tp.all_reduce = lambda x, sent=sent: sent.append(x.clone()) or x
            shard = torch.zeros(6, lay.vocab_per_rank)  # padding columns: zero logits, as the lm_head gives
            shard[:, : lay.vocab[1] - lay.vocab[0]] = rows[:, lay.vocab[0] : lay.vocab[1]]
            vocab_parallel_argmax(tp, shard)
            groups.append((tp, shard))
        total = sum(sent)
        for tp, shard in groups:  # ... and after it, with every rank's candidates summed
            tp.all_reduce = lambda x, total=total: total.clone()
            assert vocab_parallel_argmax(tp, shard).tolist() == want, size
    assert layouts[-1].vocab_per_rank * 4 - 1001 == 3  # the last rank had padding columns


class _Proc:
    def __init__(self, alive=True, pid=12345):
        self.pid, self.exitcode, self._alive = pid, None if alive else -9, alive

    def is_alive(self):
        return self._alive


def test_watchdog_names_the_rank_that_is_dead_silent_or_late(monkeypatch):
    import threading

    from inference.engine import executor
    from inference.engine.executor import HEARTBEAT_TIMEOUT_S, SILENT_TIMEOUT_S, WorkerProcesses

    states = {}
    monkeypatch.setattr(executor, "process_state", lambda pid: states.get(pid, "sleeping"))
    w = WorkerProcesses.__new__(WorkerProcesses)
    w.procs, w.beats, w.done = [_Proc(pid=11), _Proc(pid=12)], [100.0, 100.0], [7, 7]
    w.sent, w._sent_at, w._lock = 7, {6: 90.0, 7: 99.0}, threading.Lock()
    assert w.check(step_timeout=30, now=101.0) is None and w._sent_at == {}  # finished steps are forgotten
    # Silent a little while, still running (a long call holding its GIL): not yet.
    w.beats[1] = 100.0 - HEARTBEAT_TIMEOUT_S - 1
    assert w.check(30, now=100.0) is None
    states[12] = "stopped"  # SIGSTOP: at once
    assert (
        w.check(30, now=100.0) == "tensor-parallel rank 2 stopped responding: no heartbeat for 6 s (process 12 stopped)"
    )
    states[12] = "sleeping"
    w.beats[1] = 100.0 - SILENT_TIMEOUT_S - 1  # silent for long, whatever its state
    assert "rank 2 stopped responding: no heartbeat for 21 s (process 12 sleeping)" == w.check(30, now=100.0)[16:]
    w.beats[1] = 100.0
    w.sent, w._sent_at, w.done = 8, {8: 60.0}, [8, 7]
    assert w.check(30, now=85.0) is None  # 25 s: still within the step timeout
    cause = w.check(30, now=95.0)
    assert "step 8 has not finished on rank 2 after 35 s" in cause and "hung" in cause
    w.procs[0] = _Proc(alive=False)
    assert w.check(30, now=95.0) == "tensor-parallel rank 1 has exited (code -9)"


# ----------------------------------------------------------------------------- running split


def run_plans(engine: LLMEngine, plans: list[StepPlan]) -> list[torch.Tensor]:
    return [engine.runner.forward_step(plan)[0] for plan in plans]


@pytest.mark.slow
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


@pytest.mark.slow
def test_greedy_generation_equals_single_device(engines):
    single, split = engines
    outputs = []
    for engine in (single, split):
        for i, n in enumerate([3, 9, 14, 21, 30]):  # 21 and 30 prefill in chunks beside decodes
            engine.add_request(
                GenerationRequest(str(i), prompt(10 + i, n), SamplingParams(temperature=0, max_tokens=12, logprobs=3))
            )
        engine.add_request(
            GenerationRequest("sampled", prompt(20, 11), SamplingParams(temperature=1.0, seed=7, max_tokens=12))
        )
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


@pytest.mark.slow
async def test_async_engine_shutdown_stops_the_workers(engines):
    engine = AsyncEngine(engines[1])
    workers = engine.engine.runner.workers
    pids = workers.pids
    assert len(pids) == 1 and alive(pids[0])
    deltas = [
        d
        async for d in engine.generate(
            GenerationRequest("r", prompt(5, 6), SamplingParams(temperature=0, max_tokens=4))
        )
    ]
    assert sum(len(d.token_ids) for d in deltas) == 4
    await engine.shutdown()
    assert not any(alive(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
    assert not torch.distributed.is_initialized()  # rank 0 left the group too


@pytest.mark.slow
def test_workers_exit_when_rank_0_is_killed(checkpoint, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, time
        from inference.engine.core import LLMEngine

        if __name__ == "__main__":
            engine = LLMEngine.from_pretrained({str(checkpoint)!r}, tensor_parallel_size=2, **{OPTIONS!r})
            print(*engine.runner.workers.pids, flush=True)
            time.sleep(120)
    """)
    )
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


def test_tensor_parallel_options_are_checked():
    from inference.config import EngineConfig

    EngineConfig(tensor_parallel_size=2, tp_all_reduce="nccl", moe_parallel="expert", tp_step_timeout=5).validate()
    for bad, match in [
        (dict(tp_all_reduce="multimem"), "tp_all_reduce must be one of auto, symm_mem, nccl, none"),
        (dict(moe_parallel="data"), "moe_parallel must be one of tensor, expert"),
        (dict(tp_step_timeout=0), "tp_step_timeout"),
        (dict(tp_step_timeout=True), "tp_step_timeout"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad).validate()


def test_serve_flag_reaches_the_engine_config():
    import argparse

    from agent_server.cli.serve import add_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_options(parser.parse_args(["--tensor-parallel-size", "2"]))["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in engine_options(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tensor-parallel-size", "0"])


@pytest.mark.slow
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
        first = await collect(
            process.generate(GenerationRequest("a", prompt(6, 6), SamplingParams(temperature=0, max_tokens=3)))
        )
        assert first[-1].finish_reason == "length"
        worker = [p for p in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
        os.kill(int(worker[0]), signal.SIGKILL)
        time.sleep(0.5)
        last = await asyncio.wait_for(
            collect(
                process.generate(GenerationRequest("b", prompt(7, 6), SamplingParams(temperature=0, max_tokens=3)))
            ),
            60,
        )
        assert last[-1].finish_reason == "error"
        deadline = time.monotonic() + 30
        while process.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "rank 1" in (process.failure or "")
    finally:
        await process.shutdown()


@pytest.mark.slow
def test_switching_collectives_and_routing_on_every_rank(engines):
    """`configure_tensor_parallel` reaches every rank: with no all-reduce ("none") each rank keeps
    its partial sums and the logits are wrong; back on ("auto"), right again. Decisive routing
    (the same experts for every token, on every rank) changes the model the same way on one
    device and on two."""
    single, split = engines
    tokens = prompt(3, 9)

    def logits(engine):
        table = PageTable()
        engine.cache.reserve(table, 0, len(tokens))
        try:
            plan = StepPlan(tokens, [table.full], [table.sliding], [0], [len(tokens)], list(range(len(tokens))))
            return engine.runner.forward_step(plan)[0]
        finally:
            engine.cache.release(table)

    want = logits(single)
    try:
        split.configure_tensor_parallel(all_reduce="none")
        assert (logits(split) - want).abs().max() > 0.1
        split.configure_tensor_parallel(all_reduce="auto")
        torch.testing.assert_close(logits(split), want, rtol=1e-4, atol=1e-4)
        for engine in (single, split):
            engine.configure_tensor_parallel(decisive_routing=True)
        decisive = logits(single)
        assert (decisive - want).abs().max() > 0.1
        torch.testing.assert_close(logits(split), decisive, rtol=1e-4, atol=1e-4)
    finally:
        for engine in (single, split):
            engine.configure_tensor_parallel(decisive_routing=False)
    torch.testing.assert_close(logits(split), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="symm_mem.*unavailable"):  # peer memory needs CUDA
        split.configure_tensor_parallel(all_reduce="symm_mem")


def greedy_runs(engine, prompts: list[list[int]], logprobs: int | None) -> dict[str, tuple[list[int], list]]:
    for i, ids in enumerate(prompts):
        engine.add_request(
            GenerationRequest(str(i), ids, SamplingParams(temperature=0, max_tokens=10, logprobs=logprobs))
        )
    return tokens_and_logprobs(engine)


@pytest.mark.slow
@pytest.mark.parametrize("size,moe_parallel", [(4, "tensor"), (4, "expert"), (2, "expert")])
def test_greedy_generation_over_more_ranks_and_experts_equals_single_device(
    checkpoint, checkpoint4, shared_engines, size, moe_parallel
):
    """TP 4 (heads, expert columns and vocabulary split four ways), EP 4 (one whole expert a rank)
    and EP 2: greedy tokens equal one device's. Greedy steps without logprobs never gather the
    logits (each rank's argmax, combined); steps with logprobs gather them, and match too."""
    if "split" in shared_engines:  # one tensor-parallel group per process
        shared_engines.pop("split").close()
    path = checkpoint4 if size == 4 else checkpoint
    lengths = [3, 9, 14, 21, 30]  # 21 and 30 prefill in chunks beside decodes
    prompts = [prompt(40 + i, n) for i, n in enumerate(lengths)]
    single = LLMEngine.from_pretrained(path, **OPTIONS)
    split = LLMEngine.from_pretrained(path, tensor_parallel_size=size, moe_parallel=moe_parallel, **OPTIONS)
    try:
        assert split.model.tp.layout.moe_parallel == moe_parallel and split.model.tp.size == size
        gathers = []
        gather = split.model.tp.gather_vocab
        split.model.tp.gather_vocab = lambda logits: gathers.append(logits.shape) or gather(logits)
        want, got = greedy_runs(single, prompts, None), greedy_runs(split, prompts, None)
        assert {rid: t for rid, (t, _) in got.items()} == {rid: t for rid, (t, _) in want.items()}
        assert gathers == []  # every step took the vocabulary-parallel argmax
        want, got = greedy_runs(single, prompts, 2), greedy_runs(split, prompts, 2)
        assert gathers  # logprobs need the whole row: gathered
        for rid in want:
            assert got[rid][0] == want[rid][0], f"request {rid}"
            for w, g in zip(want[rid][1], got[rid][1]):
                assert abs(w.logprob - g.logprob) < 1e-4 and [t for t, _ in w.top] == [t for t, _ in g.top]
    finally:
        split.close()


@pytest.mark.slow
async def test_a_stopped_worker_fails_the_engine_within_seconds(checkpoint, shared_engines):
    """kill -STOP on a worker mid-generation: rank 0 waits in a collective that never ends; its
    watchdog sees the worker's heartbeat stop, kills the workers (the collective then fails)
    and fails the engine: the stream ends with an error naming the rank and what is wrong, within
    seconds, and `failure` (what /health reports) says the same."""
    from inference.engine.executor import HEARTBEAT_TIMEOUT_S

    if "split" in shared_engines:
        shared_engines.pop("split").close()
    engine = AsyncEngine(LLMEngine.from_pretrained(checkpoint, tensor_parallel_size=2, **OPTIONS))
    worker = engine.engine.runner.workers.pids[0]
    try:
        stream = engine.generate(GenerationRequest("long", prompt(8, 6), SamplingParams(temperature=0, max_tokens=200)))
        first = await anext(stream)
        assert first.finish_reason is None
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()
        deltas = [d async for d in stream]
        took = time.monotonic() - stopped_at
        last = deltas[-1]
        assert last.finish_reason == "error"
        assert "rank 1 stopped responding" in last.error and "stopped)" in last.error, last.error
        assert took < HEARTBEAT_TIMEOUT_S + 10, took
        assert "rank 1 stopped responding" in (engine.failure or "")
        assert not alive(worker)  # killed, not left stopped
        with pytest.raises(RuntimeError, match="rank 1"):
            engine.generate(GenerationRequest("next", prompt(9, 6), SamplingParams(temperature=0, max_tokens=4)))
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
        await engine.shutdown()
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
async def test_an_idle_engine_process_stops_when_a_worker_stops(checkpoint, shared_engines):
    """In an engine process the watchdog wakes the idle loop, which stops and tells the server
    why: the server's `failure` (its /health) names the rank without any request to notice it."""
    from inference.engine.process import EngineProcess, EngineSpec

    if "split" in shared_engines:
        shared_engines.pop("split").close()
    process = EngineProcess(EngineSpec(model_dir=str(checkpoint), options={**OPTIONS, "tensor_parallel_size": 2}))
    worker = None
    try:
        await process.wait_idle()
        worker = int(Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()[0])
        os.kill(worker, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while process.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert "rank 1 stopped responding" in (process.failure or ""), process.failure
    finally:
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)
        await process.shutdown()
