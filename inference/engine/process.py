"""The engine in a process of its own, behind the same `EngineClient` interface as `AsyncEngine`.

In one process the HTTP server's event loop and `AsyncEngine`'s thread share one GIL. At 64
streams the server spends tens of microseconds of Python on every token it streams (SSE, JSON,
the Harmony parser), so the engine thread waits for the GIL between its steps and decode slows
down (docs/benchmark-log.md, "Through HTTP"). `EngineProcess` runs the same loop (`EngineDriver`) in a
child process with its own interpreter:

    server process (event loop)                  engine process (its loop)
    generate() -> ("add", request) --commands--> read between steps (waited on when idle)
    queues <- add_reader callback <---events---- one ("pass", deltas, stats, ...) a loop pass

Requests are checked in the server process (`check_request`), so a bad one still raises before
its stream starts. Every loop pass sends one message: the pass's deltas, the engine's stats and
cache usage, and how many commands it has applied, from which `wait_idle` knows that nothing sent
is still pending. If the engine process dies, every open stream ends with an "error" delta and
`generate` refuses new requests. If the server process dies, the engine process sees its command
pipe close and exits. If a tensor-parallel worker dies or hangs (`executor.py`'s watchdog), the
engine process stops with that cause, also when idle or when its own step can never finish (a
GPU waiting in a collective for the lost rank: after STUCK_GRACE_S it reports the cause and
exits), so the server's `/health` answers 503 with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback
from dataclasses import dataclass, field

from inference.config import ModelConfig
from inference.engine.async_engine import AsyncEngine
from inference.engine.client import StreamingEngineClient, put_deltas
from inference.engine.core import LLMEngine
from inference.engine.driver import EngineDriver
from inference.gc_policy import settle_heap
from inference.request import EngineStats, GenerationRequest, TokenDelta
from inference.scheduling.kv_cache import CacheUsage

log = logging.getLogger(__name__)

STUCK_GRACE_S = 3.0  # after a tensor-parallel failure, how long a step may still take to come back


@dataclass(frozen=True)
class EngineSpec:
    """How the engine process builds its engine (sent to it, so plain values only).

    model_dir: a HF gpt-oss checkpoint (`LLMEngine.from_pretrained`); or random_config: a HF
    config dict for random weights of its shapes (`LLMEngine.from_random`, benchmarks).
    options: `from_pretrained` / `from_random` keywords (device, dtype, EngineConfig fields).
    log_level: the engine process's logging level (its records go to stderr, as the server's).
    """

    model_dir: str | None = None
    random_config: dict | None = None
    model_name: str | None = None
    options: dict = field(default_factory=dict)
    log_level: str = "WARNING"

    def build(self) -> LLMEngine:
        if (self.model_dir is None) == (self.random_config is None):
            raise ValueError("an EngineSpec names a model_dir or a random_config, not both or neither")
        if self.model_dir is not None:
            return LLMEngine.from_pretrained(self.model_dir, model_name=self.model_name, **self.options)
        return LLMEngine.from_random(
            ModelConfig.from_dict(self.random_config), model_name=self.model_name or "gpt-oss-random", **self.options
        )


def start_engine_client(spec: EngineSpec, own_process: bool) -> StreamingEngineClient:
    """The engine `spec` describes, in a process of its own (`EngineProcess`) or on a thread of
    this one (`AsyncEngine`)."""
    return EngineProcess(spec) if own_process else AsyncEngine(spec.build())


class EngineProcess(StreamingEngineClient):
    """`LLMEngine` in a child process, streaming to asyncio (implements `EngineClient`).

    Construction starts the process and returns once its engine is built (weights loaded, CUDA
    graphs captured), raising RuntimeError with the child's traceback if that failed.

    The engine's events are read in the event loop that uses it (`add_reader`): a delta wakes
    the loop directly, with no thread in between (each hop cost about 0.1-0.2 ms of TTFT under
    gVisor on the GPU machines). The server has one loop; where loops run one after another
    (tests), the next one takes the reading over, and a loop on another thread gets its deltas
    through `call_soon_threadsafe`."""

    def __init__(self, spec: EngineSpec):
        super().__init__()
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        their_commands, self._commands = ctx.Pipe(duplex=False)
        _enlarge_pipe(self._commands.fileno())
        self._events, their_events = ctx.Pipe(duplex=False)
        # Not a daemon: a tensor-parallel engine starts worker processes of its own.
        self._process = ctx.Process(
            target=_engine_process_main, args=(spec, their_commands, their_events), name="oss-agent-engine"
        )
        self._process.start()
        their_commands.close()
        their_events.close()
        try:
            message = self._events.recv()
        except EOFError:
            self._process.join(10)
            raise RuntimeError(f"the engine process exited (code {self._process.exitcode}) before it was ready")
        if message[0] == "failed":
            self._process.join(10)
            raise RuntimeError(f"the engine process could not build its engine:\n{message[1]}")
        _, info = message
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self._stats: EngineStats = info["stats"]
        self._usage: CacheUsage = info["usage"]
        self._lock = threading.Lock()  # _sinks, _sent, _ended (loops on other threads)
        self._send_lock = threading.Lock()  # the command pipe (one writer at a time)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._sent = 0  # commands sent; the engine process reports how many it has applied
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False
        self._ended: str | None = None  # why the engine process is gone, once it is
        self._gone = threading.Event()  # set with _ended
        self._reader_loop: asyncio.AbstractEventLoop | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer serve (its process exited without being shut down), or
        None. The server reports it on /health and /ready."""
        if self._stopping:
            return None
        if self._ended is None and not self._process.is_alive():
            return f"the engine process exited (code {self._process.exitcode})"
        return self._ended

    # -- EngineClient --------------------------------------------------------------------------

    def _check_serving(self) -> None:
        if self._stopping:
            raise RuntimeError("the engine is shut down")
        failure = self.failure  # also a process that died before this loop read its pipe's end
        if failure:
            raise RuntimeError(failure)

    def _open(self, request: GenerationRequest, queue: asyncio.Queue) -> None:
        self._attach()
        with self._lock:
            ended = self._ended
            if ended is None:
                self._sinks[request.request_id] = (asyncio.get_running_loop(), queue)
        if ended is not None:
            queue.put_nowait(_ended_delta(request.request_id, ended, self._stopping))
        else:
            self._submit(("add", request))

    async def wait_idle(self) -> None:
        """Return once every submitted request has finished."""
        self._attach()
        await asyncio.to_thread(self._idle.wait)

    async def shutdown(self, timeout: float = 60.0) -> None:
        """Abort what is still running (streams end with finish_reason "abort"), stop the engine
        process and wait for it (terminated after `timeout` seconds)."""
        self._attach()
        if not self._stopping:
            self._stopping = True
            self._submit(("stop",))
        await asyncio.to_thread(self._gone.wait, timeout)
        await asyncio.to_thread(self._process.join, timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s; terminating it", timeout)
            self._process.terminate()
            await asyncio.to_thread(self._process.join, 10)
        self._end()
        self._commands.close()
        self._events.close()

    def stop_now(self, timeout: float = 30.0) -> None:
        """`shutdown` without an event loop, for a process that never served (another replica
        failed to start): ask it to stop, wait, terminate it if it does not."""
        self._stopping = True
        self._submit(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        self._commands.close()
        self._events.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _submit(self, command: tuple) -> None:
        with self._lock:
            if self._ended is not None:
                return
            self._sent += 1
            self._idle.clear()
        try:
            with self._send_lock:
                self._commands.send(command)
        except (OSError, ValueError):  # the process is gone: the event reader ends the streams
            log.debug("engine command %s not sent: the engine process is gone", command[0])

    def _attach(self) -> None:
        """Read the engine's events in the running loop, unless a loop running on another
        thread already does."""
        loop = asyncio.get_running_loop()
        old = self._reader_loop
        if old is loop or self._ended is not None or (old is not None and old.is_running()):
            return
        if old is not None and not old.is_closed():
            old.remove_reader(self._events.fileno())
        loop.add_reader(self._events.fileno(), self._on_events)
        self._reader_loop = loop

    def _on_events(self) -> None:
        """The pipe is readable: hand every waiting pass's deltas to their streams."""
        try:
            while self._events.poll():
                message = self._events.recv()
                if message[0] == "stopped":
                    self._end(message[1])
                    return
                _, deltas, stats, usage, applied, idle = message
                self._stats, self._usage = (
                    stats,
                    usage,
                )  # first: a consumer handed its last delta reads stats that count it
                self._deliver(deltas)
                with self._lock:
                    if idle and applied == self._sent:
                        self._idle.set()
        except (EOFError, OSError):  # the engine process is gone
            self._end()

    def _end(self, cause: str | None = None) -> None:
        """The engine process is gone (stopped, or died; `cause`: why it stopped by itself): end
        every open stream. Idempotent."""
        with self._lock:
            if self._ended is not None:
                return
        loop = self._reader_loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._events.fileno())
        if not self._stopping:
            self._process.join(1)  # it died: its exit code, for the streams and the log
        reason = (
            "the engine was shut down"
            if self._stopping
            else cause or f"the engine process exited (code {self._process.exitcode})"
        )
        with self._lock:
            self._ended = reason
            sinks, self._sinks = self._sinks, {}
            self._idle.set()
            self._gone.set()
        if not self._stopping:
            log.error("%s; %d open streams end with an error", reason, len(sinks))
        self._deliver([_ended_delta(rid, reason, self._stopping) for rid in sinks], sinks)

    def _deliver(self, deltas: list[TokenDelta], sinks: dict | None = None) -> None:
        """Each delta to its stream's queue: directly on this loop, through one
        `call_soon_threadsafe` per other loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]] = {}
        with self._lock:
            for delta in deltas:
                sink = (sinks if sinks is not None else self._sinks).get(delta.request_id)
                if sink is None:
                    continue
                if delta.finish_reason is not None and sinks is None:
                    del self._sinks[delta.request_id]
                by_loop.setdefault(sink[0], []).append((sink[1], delta))
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, items in by_loop.items():
            if loop is here:
                put_deltas(items)
                continue
            try:
                loop.call_soon_threadsafe(put_deltas, items)
            except RuntimeError:  # the consumer's event loop is gone
                for _, delta in items:
                    if delta.finish_reason is None:
                        self._submit(("abort", delta.request_id))


def _enlarge_pipe(fd: int, size: int = 1 << 20) -> None:
    """Let the command pipe hold 1 MB (Linux; 64 KB otherwise): the engine process reads it only
    between steps, and a sender finding it full would wait for the step (a 131k-token prompt
    pickles to about 0.65 MB)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (ImportError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size
        pass


def _ended_delta(request_id: str, reason: str, stopping: bool) -> TokenDelta:
    if stopping:
        return TokenDelta(request_id, [], finish_reason="abort")
    return TokenDelta(request_id, [], finish_reason="error", error=reason)


# -- the engine process -----------------------------------------------------------------------


def _engine_process_main(spec: EngineSpec, commands, events) -> None:
    """The engine process: build the engine, then run its loop until "stop" or the server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    logging.basicConfig(
        level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [engine process] %(message)s"
    )
    events = _Events(events)
    try:
        engine = spec.build()
    except BaseException:
        events.send(("failed", traceback.format_exc()))
        return
    frozen = settle_heap()  # the collector out of the streams' way (inference/gc_policy.py)
    log.debug("froze %d objects; young collections every %d", frozen, gc.get_threshold()[0])
    events.send(
        (
            "ready",
            {
                "model_name": engine.model_name,
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.vocab_size,
                "stats": engine.stats(),
                "usage": engine.cache_usage(),
            },
        )
    )
    driver = EngineDriver(engine)
    applied = 0
    failure = None
    commands = _CommandReader(commands)
    passes = _Passes()
    workers = engine.runner.workers
    if workers is not None:
        workers.on_failure = lambda cause: _after_rank_failure(cause, commands, passes, events)
    try:
        while True:
            applied, stop = _engine_pass(driver, commands, events, applied, passes)
            if stop:
                break
            failure = engine.failure
            if failure:  # no step can run any more (a tensor-parallel worker exited): the server is told
                log.error("%s; the engine process stops", failure)
                break
    except (EOFError, OSError):  # the server process is gone (its end of a pipe closed)
        log.warning("the server process is gone; the engine process stops")
    finally:
        engine.close()
        gc.unfreeze()  # collectable again at exit: extension types check for leaks there (nanobind)
    try:
        events.send(("stopped", failure))
    except OSError:
        pass


class _Events:
    """The events pipe, one sender at a time (the loop, or the watchdog's last word)."""

    def __init__(self, conn):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            self._conn.send(message)

    def try_send(self, message, timeout: float) -> None:
        if self._lock.acquire(timeout=timeout):
            try:
                self._conn.send(message)
            except OSError:
                pass
            finally:
                self._lock.release()


class _Passes:
    """Where the loop is: inside a pass's step (`running`), and how many passes it has finished."""

    def __init__(self):
        self.running = False
        self.count = 0


def _after_rank_failure(cause: str, commands, passes: _Passes, events: _Events) -> None:
    """A tensor-parallel worker failed (the watchdog has killed the workers): wake an idle loop,
    which then sees `engine.failure` and stops; a loop still inside the same step STUCK_GRACE_S
    later cannot come back (its GPU waits for the lost rank): report the cause and exit."""
    commands.interrupt()
    seen = passes.count

    def stuck() -> None:
        if passes.running and passes.count == seen:
            log.error("%s; the engine's step cannot finish, so the engine process exits", cause)
            events.try_send(("stopped", cause), timeout=1.0)
            os._exit(1)

    timer = threading.Timer(STUCK_GRACE_S, stuck)
    timer.daemon = True
    timer.start()


class _CommandReader:
    """The command pipe, read by a thread of its own so that it never stays full. The engine
    process reads commands only between steps and may itself wait on the events pipe (its
    sends block while the server has not read them); a server event loop that found the
    command pipe full would wait in `send` and never read those events: both would wait
    forever. `recv` and `poll` as a `Connection`'s; EOFError once the pipe has closed."""

    _CLOSED = object()
    _WAKE = object()

    def __init__(self, conn):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._next = None  # a command taken off the queue by `poll`
        threading.Thread(target=self._read, args=(conn,), name="engine-commands", daemon=True).start()

    def _read(self, conn) -> None:
        try:
            while True:
                self._queue.put(conn.recv())
        except (EOFError, OSError):
            self._queue.put(self._CLOSED)

    def poll(self, timeout: float = 0.0) -> bool:
        if self._next is None:
            try:
                self._next = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self):
        """The next command, or None where `interrupt` woke the reader."""
        item, self._next = (self._next if self._next is not None else self._queue.get()), None
        if item is self._CLOSED:
            self._next = item  # every later call says so too
            raise EOFError
        return None if item is self._WAKE else item

    def interrupt(self) -> None:
        """Wake a `recv` waiting for a command (it returns None)."""
        self._queue.put(self._WAKE)


def _engine_pass(
    driver: EngineDriver, commands, events, applied: int, passes: _Passes | None = None
) -> tuple[int, bool]:
    """One pass of the engine process's loop: take the commands (waiting for one when idle), run
    a step, send the pass's message. Returns (commands applied so far, whether it stopped)."""
    engine = driver.engine
    passes = passes or _Passes()
    # Idle, the loop waits on the pipe itself: a request wakes it with no thread between.
    taken = [commands.recv()] if not engine.has_unfinished() else []
    while commands.poll():
        taken.append(commands.recv())
    taken = [command for command in taken if command is not None]  # (None: woken, see `interrupt`)
    passes.running = True
    try:
        deltas, stop, stalled = driver.run_pass(taken)
    finally:
        passes.running = False
        passes.count += 1
    applied += len(taken)
    if stalled:
        commands.poll(0.01)
    idle = stop or not engine.has_unfinished()
    events.send(("pass", deltas, engine.stats(), engine.cache_usage(), applied, idle))
    return applied, stop
