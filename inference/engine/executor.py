"""Tensor parallelism: one model split across N processes (one per GPU), kept in step by NCCL.

What each rank holds (Megatron-style; `ShardLayout` gives the ranges):
    attention   q heads and KV heads split evenly (N must divide both): the fused qkv projection
                takes this rank's rows of q, k and v, sinks its heads, o_proj its input columns;
                o_proj's output is a partial sum, all-reduced; its bias is loaded on rank 0 only.
    MoE         the router is replicated (every rank routes every token the same way); each
                expert's intermediate dimension is split in whole MXFP4 blocks of 32 values, as
                evenly as blocks allow (2880 = 90 blocks: 45 each at N=2, 23/23/22/22 at N=4):
                gate_up rows [2s, 2e) (HF interleaves gate j at row 2j, up j at 2j+1, so a
                contiguous row range holds matching pairs), down_proj blocks [s/32, e/32). The
                output is all-reduced; the down bias is loaded on rank 0 only.
    lm_head     vocabulary rows split (the last shard padded with zero rows); the logits are
                all-gathered so rank 0 can sample.
    replicated  embedding, norms, router.
Each rank reads only its slices from the safetensors files (`CheckpointReader.get_slice`).

Processes: rank 0 is the process that builds the engine (it keeps the scheduler, the sampler and
the HTTP server). `start_engine` spawns ranks 1..N-1; each loads its shard and builds the same
`LLMEngine` (so cache sizing, memory profiling and CUDA-graph capture run the same collectives in
the same order), then waits for steps. Every step rank 0 sends each worker the step's plain
description (`model_runner.StepPlan`: token ids, page tables, positions) over a pipe; all ranks
then run the same forward and meet in its collectives. Tensors only move through
torch.distributed (NCCL on GPU, gloo on CPU), rendezvous on 127.0.0.1. A worker exits when rank 0
closes the engine, when its pipe closes, or when its parent process disappears, so none is left
behind. NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 in every rank.

With tensor_parallel_size 1 none of this is used: the model holds no group and runs no collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from inference.model.checkpoint import expected_tensors
from inference.config import ModelConfig
from inference.ops.mxfp4 import BLOCK_SIZE

log = logging.getLogger(__name__)

RENDEZVOUS_HOST = "127.0.0.1"
# Per collective; idle time never counts (workers wait on their pipe, not in a collective).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
STARTUP_TIMEOUT_S = 600.0  # a worker's import + CUDA init + process-group join
LEAVE_TIMEOUT_S = 30.0  # shutdown: how long a rank may take to leave the group before it is killed


class TensorParallelError(ValueError):
    """tensor_parallel_size does not fit the model; the message names the field and the sizes that do."""


# ----------------------------------------------------------------------------- sharding math


@dataclass(frozen=True)
class ShardLayout:
    """The slices rank `rank` of `size` holds; every range is [start, stop).

    heads / kv_heads: attention heads; intermediate: expert intermediate columns (whole MXFP4
    blocks); vocab: lm_head rows it holds, padded with zero rows to `vocab_per_rank`.
    """

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int
    vocab_size: int


def _balanced(units: int, size: int, rank: int) -> tuple[int, int]:
    """Rank's range when `units` are split as evenly as possible (earlier ranks take the extra)."""
    per, extra = divmod(units, size)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


def intermediate_unit(config: ModelConfig) -> int:
    """Granularity of the expert split: a whole MXFP4 block, or one column for dense experts."""
    return BLOCK_SIZE if config.quantized_experts else 1


def valid_sizes(config: ModelConfig, limit: int = 64) -> list[int]:
    """Every tensor_parallel_size up to `limit` this model can be split into."""
    units = config.intermediate_size // intermediate_unit(config)
    return [
        n for n in range(1, limit + 1)
        if config.num_attention_heads % n == 0 and config.num_key_value_heads % n == 0 and n <= units
    ]


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Raise TensorParallelError unless the model splits into `size` ranks."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    works = ", ".join(map(str, valid_sizes(config)))
    for field_name in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, field_name)
        if value % size:
            raise TensorParallelError(
                f"tensor_parallel_size {size} does not divide config field '{field_name}' ({value}); "
                f"sizes that work for this model: {works}"
            )
    unit = intermediate_unit(config)
    units = config.intermediate_size // unit
    if units < size:
        what = f"{units} MXFP4 blocks of {unit} values" if unit > 1 else f"{units} columns"
        raise TensorParallelError(
            f"tensor_parallel_size {size} is more than config field 'intermediate_size' "
            f"({config.intermediate_size}, {what}) can be split into; sizes that work for this model: {works}"
        )


def shard_layout(config: ModelConfig, rank: int, size: int) -> ShardLayout:
    check_tensor_parallel_size(config, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    heads, kv = config.num_attention_heads // size, config.num_key_value_heads // size
    unit = intermediate_unit(config)
    start, stop = _balanced(config.intermediate_size // unit, size, rank)
    per_rank = -(-config.vocab_size // size)
    vocab_start = min(rank * per_rank, config.vocab_size)
    return ShardLayout(
        rank=rank,
        size=size,
        heads=(rank * heads, (rank + 1) * heads),
        kv_heads=(rank * kv, (rank + 1) * kv),
        intermediate=(start * unit, stop * unit),
        vocab=(vocab_start, min(vocab_start + per_rank, config.vocab_size)),
        vocab_per_rank=per_rank,
        vocab_size=config.vocab_size,
    )


def local_config(config: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """The config of the layers this rank builds: its heads, KV heads and expert columns
    (vocab stays global: the embedding is replicated and the logits are gathered back)."""
    return dataclasses.replace(
        config,
        num_attention_heads=layout.heads[1] - layout.heads[0],
        num_key_value_heads=layout.kv_heads[1] - layout.kv_heads[0],
        intermediate_size=layout.intermediate[1] - layout.intermediate[0],
    )


# Where each checkpoint tensor is cut: name suffix -> (rule, dim). Rules: "heads" / "kv_heads"
# (head_dim rows or columns per head), "heads1" (one entry per head), "gate_up" (rows 2s..2e of
# the interleaved gate/up), "inter" (intermediate columns), "inter_blocks" (MXFP4 blocks of them),
# "vocab", "rank0" (a bias after a reduction: rank 0 holds it, the others zeros). The rest is
# replicated.
_RULES: dict[str, tuple[str, int]] = {
    "self_attn.q_proj.weight": ("heads", 0),
    "self_attn.q_proj.bias": ("heads", 0),
    "self_attn.k_proj.weight": ("kv_heads", 0),
    "self_attn.k_proj.bias": ("kv_heads", 0),
    "self_attn.v_proj.weight": ("kv_heads", 0),
    "self_attn.v_proj.bias": ("kv_heads", 0),
    "self_attn.o_proj.weight": ("heads", 1),
    "self_attn.o_proj.bias": ("rank0", 0),
    "self_attn.sinks": ("heads1", 0),
    "mlp.experts.gate_up_proj_blocks": ("gate_up", 1),  # [E, 2I, H/32, 16]
    "mlp.experts.gate_up_proj_scales": ("gate_up", 1),  # [E, 2I, H/32]
    "mlp.experts.gate_up_proj_bias": ("gate_up", 1),  # [E, 2I]
    "mlp.experts.gate_up_proj": ("gate_up", 2),  # dense [E, H, 2I]
    "mlp.experts.down_proj_blocks": ("inter_blocks", 2),  # [E, H, I/32, 16]
    "mlp.experts.down_proj_scales": ("inter_blocks", 2),  # [E, H, I/32]
    "mlp.experts.down_proj": ("inter", 1),  # dense [E, I, H]
    "mlp.experts.down_proj_bias": ("rank0", 0),
    "lm_head.weight": ("vocab", 0),
}


def shard_rule(name: str) -> tuple[str, int] | None:
    """(rule, dim) for a checkpoint tensor name, None when it is replicated."""
    if name == "lm_head.weight":
        return _RULES[name]
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    return _RULES.get(suffix)


class ShardedTensorSource:
    """`get(name)` over one rank's slices of a checkpoint (or of any full-tensor source).

    get_slice(name, dim, start, stop): the tensor's [start, stop) range along dim (ideally
    reading only those bytes); get(name): a whole (replicated) tensor. `bytes_read` counts what
    this rank took from the source.
    """

    def __init__(self, config: ModelConfig, layout: ShardLayout, get_slice, get):
        self.config, self.layout = config, layout
        self.specs = expected_tensors(config)
        self._get_slice, self._get = get_slice, get
        self.bytes_read = 0

    def range_of(self, rule: str) -> tuple[int, int]:
        lay, d = self.layout, self.config.head_dim
        if rule == "heads":
            return lay.heads[0] * d, lay.heads[1] * d
        if rule == "kv_heads":
            return lay.kv_heads[0] * d, lay.kv_heads[1] * d
        if rule == "heads1":
            return lay.heads
        if rule == "gate_up":
            return 2 * lay.intermediate[0], 2 * lay.intermediate[1]
        if rule == "inter":
            return lay.intermediate
        if rule == "inter_blocks":
            return lay.intermediate[0] // BLOCK_SIZE, lay.intermediate[1] // BLOCK_SIZE
        if rule == "vocab":
            return lay.vocab
        raise ValueError(f"unknown shard rule {rule!r}")

    def __call__(self, name: str) -> torch.Tensor:
        rule = shard_rule(name)
        if rule is None:
            return self._count(self._get(name))
        kind, dim = rule
        if kind == "rank0":
            if self.layout.rank == 0:
                return self._count(self._get(name))
            return torch.zeros(self.specs[name].shape)  # never read: added once, by rank 0
        start, stop = self.range_of(kind)
        part = self._count(self._get_slice(name, dim, start, stop))
        if kind == "vocab" and stop - start < self.layout.vocab_per_rank:
            pad = list(part.shape)
            pad[0] = self.layout.vocab_per_rank - (stop - start)
            part = torch.cat([part, torch.zeros(pad, dtype=part.dtype, device=part.device)])
        return part

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def slice_of(get: Callable[[str], torch.Tensor]):
    """A get_slice for a source that can only make whole tensors (random weights): make, cut, copy."""

    def get_slice(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return get(name).narrow(dim, start, stop - start).clone()

    return get_slice


# ----------------------------------------------------------------------------- the process group


class TensorParallelGroup:
    """This process's rank in the group, its shard layout, and the collectives the model runs.

    `group` is None only for loading a shard without running it (tests, offline checks).
    """

    def __init__(self, layout: ShardLayout, device: torch.device, group=None):
        self.layout = layout
        self.rank, self.size = layout.rank, layout.size
        self.device = torch.device(device)
        self.group = group
        self.bytes_read = 0  # checkpoint bytes this rank read while loading

    def tensor_source(self, config: ModelConfig, get_slice, get) -> ShardedTensorSource:
        return ShardedTensorSource(config, self.layout, get_slice, get)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x (in place)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary shard of the logits side by side: [T, V/N] -> [T, V]."""
        t, shard = logits.shape
        out = torch.empty(self.size * t, shard, dtype=logits.dtype, device=logits.device)
        _all_gather_single(out, logits.contiguous(), group=self.group)  # rank r's rows at [r*T, (r+1)*T)
        return out.view(self.size, t, shard).permute(1, 0, 2).reshape(t, self.size * shard)[:, : self.layout.vocab_size]

    def min_across_ranks(self, value: int) -> int:
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def leave(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None


# torch 2.13 renamed all_gather_into_tensor; older releases (GPU hosts) only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _join_group(config: ModelConfig, rank: int, size: int, device: torch.device, store) -> TensorParallelGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda":  # create the NCCL communicator now: it cannot be created inside a graph capture
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    return TensorParallelGroup(shard_layout(config, rank, size), device, dist.group.WORLD)


# ----------------------------------------------------------------------------- launching


@dataclass(frozen=True)
class ModelSource:
    """Where every rank gets its weights: a checkpoint directory, or random weights of `config`
    made from `seed` (the same on every rank, so the shards form one model)."""

    model_dir: str | None = None
    random_config: ModelConfig | None = None
    seed: int = 0
    decisive_routing: bool = False  # see `random_tensor_source`

    def config(self) -> ModelConfig:
        return self.random_config if self.model_dir is None else ModelConfig.from_file(self.model_dir)

    def load(self, tp: TensorParallelGroup | None, **options):
        from inference.model.gpt_oss import GptOssModel

        if self.model_dir is not None:
            return GptOssModel.from_pretrained(self.model_dir, tensor_parallel=tp, **options)
        return GptOssModel.from_random(self.random_config, seed=self.seed, tensor_parallel=tp,
                                       decisive_routing=self.decisive_routing, **options)


@dataclass(frozen=True)
class _WorkerSpec:
    source: ModelSource
    engine_config: object  # EngineConfig
    devices: tuple[str, ...]
    load_options: dict
    store_port: int
    parent_pid: int


def rank_devices(device, size: int) -> list[torch.device]:
    """One device per rank: consecutive GPUs from `device` on (default cuda:0), or CPU for all."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cuda or cpu devices, not {device.type}")
    first = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size {size} needs GPUs {first}..{first + size - 1}; {count} are visible"
        )
    return [torch.device("cuda", first + r) for r in range(size)]


def start_engine(source: ModelSource, engine_config, *, device=None, dtype=None, attention_backend=None,
                 moe_backend=None, model_name: str = "gpt-oss"):
    """Build an `LLMEngine` over `engine_config.tensor_parallel_size` ranks; this process is rank 0.

    Size 1 builds the ordinary single-device engine. Raises TensorParallelError (before starting
    any process) when the model does not split into that many ranks. `engine.close()` stops the
    workers. They are spawned (CUDA cannot be forked), which re-imports the main script: a script
    that calls this must do so under `if __name__ == "__main__":`.
    """
    from inference.engine.core import LLMEngine

    engine_config.validate()
    size = engine_config.tensor_parallel_size
    load_options = dict(dtype=dtype, attention_backend=attention_backend, moe_backend=moe_backend,
                        max_positions=engine_config.max_model_len)
    if size == 1:
        return LLMEngine(source.load(None, device=device, **load_options), engine_config, model_name=model_name)
    config = source.config()
    check_tensor_parallel_size(config, size)
    devices = rank_devices(device, size)
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: "
                           "one tensor-parallel engine per process")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # rank 0 is a NCCL peer too; workers inherit it
    store = dist.TCPStore(RENDEZVOUS_HOST, 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    spec = _WorkerSpec(source, engine_config, tuple(str(d) for d in devices), load_options, store.port, os.getpid())
    workers = WorkerProcesses(spec, size)
    tp = None
    try:
        workers.expect("started")
        tp = _join_group(config, 0, size, devices[0], store)
        workers.group = tp
        model = source.load(tp, device=devices[0], **load_options)
        workers.bytes_read = [tp.bytes_read, *workers.expect("loaded")]
        # Building the engine runs collectives (memory profile, CUDA graphs): start them together,
        # so a slow load on one rank does not count against another's collective timeout.
        workers.send("build")
        engine = LLMEngine(model, engine_config, model_name=model_name)
        workers.expect("ready")
    except BaseException:
        workers.close()
        if tp is not None:
            tp.leave()
        raise
    gib = 1 << 30
    log.info("tensor parallel: %d ranks on %s; checkpoint GiB read per rank: %s", size,
             ", ".join(map(str, devices)), ", ".join(f"{b / gib:.2f}" for b in workers.bytes_read))
    engine.runner.workers = workers
    return engine


class WorkerProcesses:
    """Ranks 1..N-1 as seen from rank 0: started at construction, fed every step, stopped by `close`."""

    def __init__(self, spec: _WorkerSpec, size: int):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self.size = size
        self.group: TensorParallelGroup | None = None  # rank 0's, left at close
        self.bytes_read: list[int] = []
        self.conns, self.procs = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, spec, theirs), name=f"oss-agent-tp{rank}",
                               daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_workers, self.conns, self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def expect(self, tag: str, timeout: float = STARTUP_TIMEOUT_S) -> list:
        """Each worker's next message, which must be `tag`; its payloads in rank order. A worker
        that reports an error or exits raises RuntimeError with its reason."""
        payloads = []
        # A spawned worker first re-imports the main script: one that builds an engine at import
        # time (no `if __name__ == "__main__":` guard) makes the worker fail before it starts.
        hint = ("; a script that starts a tensor-parallel engine must do it under "
                "`if __name__ == \"__main__\":`") if tag == "started" else ""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            deadline = time.monotonic() + timeout
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before '{tag}'{hint}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not report '{tag}' within {timeout:.0f} s")
            try:
                got, payload = conn.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} closed its pipe before '{tag}'{hint}") from None
            if got == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{payload}")
            if got != tag:
                raise RuntimeError(f"tensor-parallel rank {rank} sent '{got}', expected '{tag}'")
            payloads.append(payload)
        return payloads

    @property
    def failure(self) -> str | None:
        """Why the group can no longer run steps (a worker exited), or None. Once closed: None."""
        return self._dead_rank() if self._finalizer.alive else None

    def _dead_rank(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} has exited (code {proc.exitcode})"
        return None

    def send(self, message) -> None:
        for conn in self.conns:
            conn.send(message)

    def send_step(self, plan) -> None:
        """Hand every worker the step rank 0 is about to run (they run it alongside)."""
        dead = self._dead_rank()
        if dead:
            raise RuntimeError(dead)
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(payload)

    def close(self, runner=None) -> None:
        """Stop the workers and leave the group, all ranks at once (destroying a NCCL group may
        wait for its peers); `runner`: rank 0's, whose CUDA graphs go first. Idempotent."""
        if not self._finalizer.alive:
            return
        _send_stop(self.conns)
        if runner is not None:
            release_cuda_graphs(runner)
        if self.group is not None:
            leaving = threading.Thread(target=self.group.leave, name="tp-leave", daemon=True)
            leaving.start()
            leaving.join(LEAVE_TIMEOUT_S)
            if leaving.is_alive():
                log.warning("leaving the tensor-parallel group did not finish in %.0f s; going on", LEAVE_TIMEOUT_S)
            self.group = None
        self._finalizer()  # waits for the workers to exit


def release_cuda_graphs(runner) -> None:
    """Free a model runner's captured CUDA graphs. A graph that captured a NCCL collective keeps
    the communicator busy: destroying the process group would wait for it forever."""
    graphs, runner.graphs = runner.graphs, None
    if graphs is None:
        return
    for captured in graphs.graphs.values():
        captured.graph.reset()
    torch.cuda.synchronize()


def _send_stop(conns) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except (OSError, ValueError):  # already gone
            pass


def _stop_workers(conns, procs, timeout: float = LEAVE_TIMEOUT_S) -> None:
    _send_stop(conns)
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            log.warning("tensor-parallel worker %s did not stop; terminating it", proc.name)
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (even killed outright), so no worker is orphaned."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_main(rank: int, spec: _WorkerSpec, conn) -> None:
    """A worker rank: join the group, load the shard, build the same engine, run steps until told to stop."""
    _watch_parent(spec.parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s %(message)s")
    logging.getLogger("inference.engine.core").setLevel(logging.ERROR)  # rank 0 logs the same cache warnings
    tp = None
    try:
        from inference.engine.core import LLMEngine

        os.environ["NCCL_NVLS_ENABLE"] = "0"
        device = torch.device(spec.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(spec.devices)))
        conn.send(("started", None))
        store = dist.TCPStore(RENDEZVOUS_HOST, spec.store_port, len(spec.devices), is_master=False,
                              timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        tp = _join_group(spec.source.config(), rank, len(spec.devices), device, store)
        model = spec.source.load(tp, device=device, **spec.load_options)
        conn.send(("loaded", tp.bytes_read))
        if conn.recv() != "build":  # None: rank 0 gave up
            raise RuntimeError("rank 0 stopped before building the engine")
        engine = LLMEngine(model, spec.engine_config)
        conn.send(("ready", None))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        if tp is not None:
            tp.leave()
        return
    try:
        while True:
            try:
                plan = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                break
            if plan is None:
                break
            try:
                engine.runner.execute(plan)
            except Exception:  # rank 0 runs the same step, hits the same error and fails its requests
                log.exception("tensor-parallel step failed")
    finally:
        release_cuda_graphs(engine.runner)
        tp.leave()
