"""`LLMEngine` on a thread of the server's process, streaming to asyncio."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from inference.device import make_device_current
from inference.engine.client import StreamingEngineClient, put_deltas
from inference.engine.core import LLMEngine
from inference.engine.driver import EngineDriver
from inference.request import GenerationRequest, TokenDelta

log = logging.getLogger(__name__)


class AsyncEngine(StreamingEngineClient):
    """`LLMEngine` on a dedicated thread, streaming to asyncio (implements `EngineClient`).

    The thread owns the engine: requests, aborts and releases reach it through an inbox and are
    applied between steps; deltas go back to each request's queue on its event loop with
    `call_soon_threadsafe`, so the event loop never waits on the model.
    """

    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._inbox: list[tuple] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine-thread side
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]] = {}  # ditto
        self._stats = engine.stats()
        self._usage = engine.cache_usage()
        self._thread = threading.Thread(target=self._loop, name="oss-agent-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str | None = None, **engine_options) -> AsyncEngine:
        """Load the model and start the engine thread; options as in `LLMEngine.from_pretrained`."""
        return cls(LLMEngine.from_pretrained(model_dir, device=device, **engine_options))

    # -- EngineClient --------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer serve (a tensor-parallel worker exited), or None. The
        server reports it on /health and /ready."""
        return None if self._stopping else self.engine.failure

    def _check_serving(self) -> None:
        if self._stopping:
            raise RuntimeError("the engine is shut down")
        failure = self.failure
        if failure:
            raise RuntimeError(failure)

    def _open(self, request: GenerationRequest, queue: asyncio.Queue) -> None:
        if self._stopping:  # the thread reads no more commands: end the stream as a stop would
            queue.put_nowait(TokenDelta(request.request_id, [], finish_reason="abort"))
            return
        self._submit(("add", request, asyncio.get_running_loop(), queue))

    async def wait_idle(self) -> None:
        """Return once every submitted request has finished."""
        await asyncio.to_thread(self._idle.wait)

    async def shutdown(self) -> None:
        """Abort what is still running (streams end with finish_reason "abort") and stop the thread.
        A thread stuck in a step that cannot end (a tensor-parallel rank lost while the GPU waits
        for it: `engine.failure` says so) is left behind after a few seconds."""
        failure = self.engine.failure
        self._stopping = True
        self._submit(("stop",))
        waited = 0.0
        while self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 1.0)
            waited += 1.0
            failure = failure or self.engine.failure
            if failure and waited >= 5 and self._thread.is_alive():
                log.error("the engine thread is stuck after %s; shutting down without it", failure)
                break
        await asyncio.to_thread(self.engine.close)

    # -- the engine thread ---------------------------------------------------------------------

    def _submit(self, command: tuple) -> None:
        with self._lock:
            self._inbox.append(command)
            self._idle.clear()
        self._wakeup.set()

    def _loop(self) -> None:
        make_device_current(self.engine.model.device)  # this thread steps the engine
        driver = EngineDriver(self.engine)
        while True:
            if not self.engine.has_unfinished():
                self._wakeup.wait()
            self._wakeup.clear()
            if self._pass(driver):
                return

    def _pass(self, driver: EngineDriver) -> bool:
        """Apply the inbox's commands, run a step, hand the deltas over; True once stopped. (A
        method of its own, so that nothing of the pass stays referenced while the thread waits.)"""
        with self._lock:
            commands, self._inbox = self._inbox, []
        for i, command in enumerate(commands):
            if command[0] == "add":  # ("add", request, loop, queue): the sink stays on this side
                _, request, loop, queue = command
                self._sinks[request.request_id] = (loop, queue)
                commands[i] = ("add", request)
        deltas, stop, stalled = driver.run_pass(commands)
        for delta in deltas:
            self._deliver(delta)
        if stalled:
            self._wakeup.wait(0.01)
        self._publish()  # first: a consumer handed its last delta then reads stats that count it
        self._flush()
        with self._lock:
            if stop or (not self._inbox and not self.engine.has_unfinished()):
                self._idle.set()
        return stop

    def _deliver(self, delta: TokenDelta) -> None:
        """Queue `delta` for its consumer; `_flush` hands a pass's deltas over."""
        sink = self._sinks.get(delta.request_id)
        if sink is None:
            return
        if delta.finish_reason is not None:
            del self._sinks[delta.request_id]
        loop, queue = sink
        self._outbox.setdefault(loop, []).append((queue, delta))

    def _flush(self) -> None:
        """One wake-up of each consumer loop for all of this pass's deltas. A wake-up per delta
        was a write to the loop's self-pipe each, and this thread taking the GIL back after
        each: a fifth of its time at 64 streams."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(put_deltas, items)
            except RuntimeError:  # the consumer's event loop is gone
                for _, delta in items:
                    if delta.finish_reason is None:
                        self.engine.abort(delta.request_id)
                        self._sinks.pop(delta.request_id, None)

    def _publish(self) -> None:
        self._stats = self.engine.stats()
        self._usage = self.engine.cache_usage()
