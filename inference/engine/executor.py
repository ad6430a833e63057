"""Tensor parallelism, the processes: rank 0 (this process) and the workers it starts and owns.

Processes: rank 0 is the process that builds the engine (it keeps the scheduler, the sampler and
the HTTP server). `start_tensor_parallel` spawns ranks 1..N-1; each loads its shard and builds the same
`LLMEngine` (so cache sizing, memory profiling and CUDA-graph capture run the same collectives in
the same order), then waits for steps. Every step rank 0 sends each worker the step's plain
description (`model_runner.StepPlan`: token ids, page tables, positions) over a pipe; all ranks
then run the same forward and meet in its collectives. Tensors only move through
torch.distributed (NCCL on GPU, gloo on CPU) and peer memory for small all-reduces
(`inference/distributed/peer_memory.py`), rendezvous on 127.0.0.1. A worker exits when rank 0
closes the engine, when its pipe closes, or when its parent process disappears, so none is left
behind. NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in every rank.

A rank that dies or hangs must not leave the engine waiting in a collective (under CUDA graphs a
peer-memory barrier spins forever). Every worker beats a heartbeat (a shared timestamp, from a
thread of its own) and counts the steps it has finished (on GPU: once the device has run them);
a watchdog thread on rank 0 fails the engine when a worker has exited, has not beaten for
HEARTBEAT_TIMEOUT_S and is stopped (or for SILENT_TIMEOUT_S, frozen), or has left a step unfinished for
`EngineConfig.tp_step_timeout` seconds (hung in a kernel or a collective). It then kills every
worker, which ends rank 0's waiting collective on gloo, and calls `on_failure`: an engine
process (`process.py`) that is still stuck after that (a GPU spinning in a collective) reports
the cause and exits. `engine.failure` carries the cause: what `/health` answers 503 with.

With tensor_parallel_size 1 none of this is used: the model holds no group and runs no collective.

What each rank holds: `inference/distributed/sharding.py`; the collectives: `inference/distributed/group.py`.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from inference.config import EngineConfig, ModelConfig
from inference.device import cuda_index
from inference.distributed.group import TensorParallelGroup, join_group
from inference.distributed.peer_memory import disable_multicast_environment
from inference.distributed.sharding import check_tensor_parallel_size
from inference.model.gpt_oss import GptOssModel

log = logging.getLogger(__name__)

RENDEZVOUS_HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0  # a worker's import + CUDA init + process-group join
LEAVE_TIMEOUT_S = 30.0  # shutdown: how long a rank may take to leave the group before it is killed
HEARTBEAT_INTERVAL_S = 0.5
# A worker silent this long, and stopped (SIGSTOP, a debugger), fails the engine; one silent for
# SILENT_TIMEOUT_S fails it whatever its state (frozen). A running process can miss beats while a
# long call holds its GIL (a Triton compile step), hence the longer wait without a clear sign.
HEARTBEAT_TIMEOUT_S = 5.0
SILENT_TIMEOUT_S = 20.0
WATCH_INTERVAL_S = 0.25


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
        if self.model_dir is not None:
            return GptOssModel.from_pretrained(self.model_dir, tensor_parallel=tp, **options)
        return GptOssModel.from_random(
            self.random_config, seed=self.seed, tensor_parallel=tp, decisive_routing=self.decisive_routing, **options
        )


@dataclass(frozen=True)
class _WorkerSpec:
    source: ModelSource
    engine_config: EngineConfig
    engine_class: type  # `LLMEngine`, given by its caller (pickled by reference to the spawned workers)
    devices: tuple[str, ...]
    load_options: dict
    store_port: int
    parent_pid: int
    peer_bytes: int  # the peer-memory all-reduce buffer (`join_group`)


def rank_devices(device, size: int) -> list[torch.device]:
    """One device per rank: consecutive GPUs from `device` on (default cuda:0), or CPU for all."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cuda or cpu devices, not {device.type}")
    first = cuda_index(device)
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(f"tensor_parallel_size {size} needs GPUs {first}..{first + size - 1}; {count} are visible")
    return [torch.device("cuda", first + r) for r in range(size)]


def start_tensor_parallel(
    source: ModelSource,
    engine_config: EngineConfig,
    engine_class: type,
    *,
    device=None,
    dtype=None,
    attention_backend=None,
    moe_backend=None,
    model_name: str = "gpt-oss",
):
    """Build an `engine_class` (`LLMEngine`) over `engine_config.tensor_parallel_size` ranks; this
    process is rank 0, and every worker builds the same class on its shard.

    Size 1 builds the ordinary single-device engine. Raises TensorParallelError (before starting
    any process) when the model does not split into that many ranks. `engine.close()` stops the
    workers. They are spawned (CUDA cannot be forked), which re-imports the main script: a script
    that calls this must do so under `if __name__ == "__main__":`.
    """
    engine_config.validate()
    size = engine_config.tensor_parallel_size
    load_options = dict(
        dtype=dtype,
        attention_backend=attention_backend,
        moe_backend=moe_backend,
        max_positions=engine_config.max_model_len,
    )
    if size == 1:
        return engine_class(source.load(None, device=device, **load_options), engine_config, model_name=model_name)
    config = source.config()
    check_tensor_parallel_size(config, size, engine_config.moe_parallel)
    devices = rank_devices(device, size)
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one tensor-parallel engine per process"
        )
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # rank 0 is a NCCL peer too; workers inherit it
    disable_multicast_environment()
    store = dist.TCPStore(
        RENDEZVOUS_HOST, 0, size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
    )
    spec = _WorkerSpec(
        source,
        engine_config,
        engine_class,
        tuple(str(d) for d in devices),
        load_options,
        store.port,
        os.getpid(),
        peer_buffer_bytes(config, engine_config),
    )
    workers = WorkerProcesses(spec, size)
    tp = None
    try:
        workers.expect("started")
        tp = _join(spec, config, 0, devices[0], store)
        workers.group = tp
        model = source.load(tp, device=devices[0], **load_options)
        workers.bytes_read = [tp.bytes_read, *workers.expect("loaded")]
        # Building the engine runs collectives (memory profile, CUDA graphs): start them together,
        # so a slow load on one rank does not count against another's collective timeout.
        workers.send("build")
        engine = engine_class(model, engine_config, model_name=model_name, workers=workers)
        workers.expect("ready")
        workers.start_watchdog(engine_config.tp_step_timeout)
    except BaseException:
        workers.close()
        if tp is not None:
            tp.leave()
        raise
    gib = 1 << 30
    log.info(
        "tensor parallel: %d ranks on %s (MoE split by %s, small all-reduces over %s); checkpoint GiB read "
        "per rank: %s",
        size,
        ", ".join(map(str, devices)),
        engine_config.moe_parallel,
        "peer memory" if tp.peer is not None else "NCCL",
        ", ".join(f"{b / gib:.2f}" for b in workers.bytes_read),
    )
    return engine


def peer_buffer_bytes(config: ModelConfig, engine_config: EngineConfig) -> int:
    """The peer-memory all-reduce buffer: the partial sums (float32) of the largest step a decode
    graph runs (`inference/runner/cuda_graphs.py`: the captured batch that covers max_num_seqs,
    and with speculation up to 32 sequences of drafts + 1 tokens)."""
    from inference.runner.cuda_graphs import DEFAULT_BATCH_SIZES

    limit = engine_config.max_num_seqs
    rows = min((b for b in DEFAULT_BATCH_SIZES if b >= limit), default=max(DEFAULT_BATCH_SIZES))
    if engine_config.speculative is not None:
        rows = max(rows, min(rows, 32) * (engine_config.num_draft_tokens + 1))
    return rows * config.hidden_size * 4


def _join(spec: _WorkerSpec, config: ModelConfig, rank: int, device: torch.device, store) -> TensorParallelGroup:
    ec = spec.engine_config
    return join_group(
        config,
        rank,
        len(spec.devices),
        device,
        store,
        moe_parallel=ec.moe_parallel,
        all_reduce=ec.tp_all_reduce,
        peer_bytes=spec.peer_bytes,
        devices=[torch.device(d) for d in spec.devices],
    )


class WorkerProcesses:
    """Ranks 1..N-1 as seen from rank 0: started at construction, fed every step, stopped by `close`."""

    def __init__(self, spec: _WorkerSpec, size: int):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self.size = size
        self.group: TensorParallelGroup | None = None  # rank 0's, left at close
        self.bytes_read: list[int] = []
        self.conns, self.procs = [], []
        # Written by the workers: their last heartbeat (time.monotonic, the same clock in every
        # process) and how many steps each has finished.
        self.beats = ctx.RawArray("d", size - 1)
        self.done = ctx.RawArray("q", size - 1)
        self.sent = 0  # steps handed to the workers
        self._sent_at: dict[int, float] = {}  # step number -> when, for steps some worker has not finished
        self._lock = threading.Lock()
        self._failure: str | None = None  # the watchdog's finding, once it has one
        self._watching = threading.Event()  # set: the watchdog stops
        self.on_failure = None  # called (from the watchdog's thread) with the cause, once the workers are killed
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, spec, theirs, self.beats, self.done),
                name=f"oss-agent-tp{rank}",
                daemon=True,
            )
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
        hint = (
            ('; a script that starts a tensor-parallel engine must do it under `if __name__ == "__main__":`')
            if tag == "started"
            else ""
        )
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            deadline = time.monotonic() + timeout
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before '{tag}'{hint}"
                    )
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
        """Why the group can no longer run steps (a worker exited, stopped responding or hung:
        see the module docstring), or None. Once closed: None."""
        if not self._finalizer.alive:
            return None
        return self._failure or self._dead_rank()

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
        failure = self.failure
        if failure:
            raise RuntimeError(failure)
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.sent += 1
            self._sent_at[self.sent] = time.monotonic()
        for conn in self.conns:
            conn.send_bytes(payload)

    def call(self, method: str, kwargs: dict) -> None:
        """Have every worker call `engine.<method>(**kwargs)` (between steps); `expect("called")`
        then waits for them. For changes every rank must make together (`LLMEngine.configure_tensor_parallel`)."""
        self.send(("call", method, kwargs))

    # -- the watchdog ----------------------------------------------------------------------------

    def start_watchdog(self, step_timeout: float) -> None:
        threading.Thread(target=self._watch, args=(step_timeout,), name="tp-watchdog", daemon=True).start()

    def _watch(self, step_timeout: float) -> None:
        while not self._watching.wait(WATCH_INTERVAL_S):
            cause = self.check(step_timeout)
            if cause is not None:
                self._fail(cause)
                return

    def check(self, step_timeout: float, now: float | None = None) -> str | None:
        """What is wrong with the workers now, or None: one exited, stopped beating its
        heartbeat, or has left a step unfinished for longer than step_timeout seconds."""
        dead = self._dead_rank()
        if dead:
            return dead
        now = time.monotonic() if now is None else now
        for rank, (proc, beat) in enumerate(zip(self.procs, self.beats), start=1):
            if now - beat > HEARTBEAT_TIMEOUT_S:
                state = process_state(proc.pid)
                if state == "stopped" or now - beat > SILENT_TIMEOUT_S:
                    return (
                        f"tensor-parallel rank {rank} stopped responding: no heartbeat for {now - beat:.0f} s "
                        f"(process {proc.pid} {state})"
                    )
        with self._lock:
            finished = min(self.done)
            for step in [s for s in self._sent_at if s <= finished]:
                del self._sent_at[step]
            late = [(step, now - at) for step, at in self._sent_at.items() if now - at > step_timeout]
        if late:
            step, waited = min(late)
            ranks = ", ".join(str(r) for r, done in enumerate(self.done, start=1) if done < step)
            return (
                f"tensor-parallel step {step} has not finished on rank {ranks} after {waited:.0f} s "
                f"(tp_step_timeout {step_timeout:g} s): a rank is hung"
            )
        return None

    def _fail(self, cause: str) -> None:
        """Fail the engine for good: record the cause, kill every worker (a collective rank 0
        waits in on gloo then ends), tell `on_failure`."""
        self._failure = cause
        log.error("%s; the tensor-parallel engine stops", cause)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        callback = self.on_failure
        if callback is not None:
            callback(cause)

    def close(self, runner=None) -> None:
        """Stop the workers and leave the group, all ranks at once (destroying a NCCL group may
        wait for its peers); `runner`: rank 0's, whose CUDA graphs go first. Idempotent."""
        if not self._finalizer.alive:
            return
        failed = self.failure is not None
        self._watching.set()
        _send_stop(self.conns)
        if failed:  # a peer is gone: a kernel waiting for it may never end, so do not wait for the device
            self._finalizer()
        elif runner is not None:
            release_cuda_graphs(runner)
        if self.group is not None:
            timeout = 5.0 if failed else LEAVE_TIMEOUT_S
            leaving = threading.Thread(target=self.group.leave, name="tp-leave", daemon=True)
            leaving.start()
            leaving.join(timeout)
            if leaving.is_alive():
                log.warning("leaving the tensor-parallel group did not finish in %.0f s; going on", timeout)
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


def process_state(pid: int) -> str:
    """What /proc says of a process: "stopped" (SIGSTOP), "sleeping", ... ("gone" if it is)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {
        "R": "running",
        "S": "sleeping",
        "D": "in uninterruptible wait",
        "T": "stopped",
        "t": "stopped",
        "Z": "a zombie",
    }.get(state, f"in state {state}")


class _Progress:
    """A worker's side of the watchdog: its heartbeat (the time, every HEARTBEAT_INTERVAL_S, from a
    thread of its own: it goes on while the main thread waits in a collective, and stops with the
    whole process) and its count of finished steps. On GPU a step is finished once the device has
    run it: the main thread records an event after each step and goes on (it never waits for the
    device), and the heartbeat's thread counts the events that have completed."""

    def __init__(self, beats, done, index: int):
        self.beats, self.done, self.index = beats, done, index
        self.pending: collections.deque = collections.deque()  # events of steps still on the device
        self.device: torch.device | None = None  # the worker's GPU, once it has run a step there
        beats[index] = time.monotonic()
        threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        on_device = False
        while True:
            self.beats[self.index] = time.monotonic()
            if self.pending and not on_device:  # this thread's CUDA calls on the worker's GPU, not GPU 0
                torch.cuda.set_device(self.device)
                on_device = True
            while self.pending and self.pending[0].query():
                self.pending.popleft()
                self.done[self.index] += 1
            time.sleep(HEARTBEAT_INTERVAL_S)

    def step_launched(self, device: torch.device) -> None:
        if device.type != "cuda":
            self.done[self.index] += 1  # CPU steps are finished when they return
            return
        event = torch.cuda.Event()
        event.record()
        self.device = device
        self.pending.append(event)


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (even killed outright), so no worker is orphaned."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_main(rank: int, spec: _WorkerSpec, conn, beats, done) -> None:
    """A worker rank: join the group, load the shard, build the same engine, run steps until told to stop."""
    _watch_parent(spec.parent_pid)
    progress = _Progress(beats, done, rank - 1)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s %(message)s")
    logging.getLogger("inference.engine.core").setLevel(logging.ERROR)  # rank 0 logs the same cache warnings
    tp = None
    try:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        disable_multicast_environment()
        device = torch.device(spec.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(spec.devices)))
        conn.send(("started", None))
        store = dist.TCPStore(
            RENDEZVOUS_HOST,
            spec.store_port,
            len(spec.devices),
            is_master=False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        tp = _join(spec, spec.source.config(), rank, device, store)
        model = spec.source.load(tp, device=device, **spec.load_options)
        conn.send(("loaded", tp.bytes_read))
        if conn.recv() != "build":  # None: rank 0 gave up
            raise RuntimeError("rank 0 stopped before building the engine")
        engine = spec.engine_class(model, spec.engine_config)
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
            if isinstance(plan, tuple) and plan[0] == "call":  # `WorkerProcesses.call`
                _, method, kwargs = plan
                try:
                    getattr(engine, method)(**kwargs)
                    conn.send(("called", None))
                except Exception:
                    conn.send(("error", traceback.format_exc()))
                continue
            try:
                engine.runner.execute(plan)
            except Exception:  # rank 0 runs the same step, hits the same error and fails its requests
                log.exception("tensor-parallel step failed")
            progress.step_launched(device)
    finally:
        release_cuda_graphs(engine.runner)
        tp.leave()
