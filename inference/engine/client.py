"""The asyncio side of an engine: one stream of deltas per request, aborted when left early.

`StreamingEngineClient` implements the `EngineClient` protocol of `inference/request.py` for the
two ways an engine runs: `AsyncEngine` (a thread) and `EngineProcess` (a process). Subclasses
say how a request reaches the engine (`_open`) and how the other commands do (`_submit`).
"""

from __future__ import annotations

import asyncio
import dataclasses

from inference.request import EngineStats, GenerationRequest, TokenDelta, check_request
from inference.scheduling.kv_cache import CacheUsage


class StreamingEngineClient:
    """The asyncio side that `AsyncEngine` and `EngineProcess` share: each request streams its
    deltas through a queue of its own (`RequestStream`), one request id runs at a time, and
    leaving a stream early aborts its request. Subclasses say how a request reaches the engine
    (`_open`) and how the other commands do (`_submit`)."""

    max_model_len: int
    vocab_size: int

    def __init__(self) -> None:
        self._active: set[str] = set()  # request ids with an open stream (event-loop side)
        self._stats: EngineStats | None = None  # as of the engine's last step this client has seen
        self._usage: CacheUsage | None = None

    def generate(self, request: GenerationRequest) -> RequestStream:
        """Validate now (ValueError for a bad request, RuntimeError once the engine is gone); the
        request is sent at the stream's `open()` or first iteration. A stream never opened leaves
        nothing behind."""
        self._check_serving()
        check_request(request, self.vocab_size, self.max_model_len)
        self._check_not_active(request.request_id)
        return RequestStream(self, request)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def release(self, request_id: str) -> None:
        self._submit(("release", request_id))

    def stats(self) -> EngineStats:
        """The counters as of the engine's last step this client has seen."""
        return self._stats

    def cache_usage(self) -> CacheUsage:
        return self._usage

    def _check_serving(self) -> None:
        """Raise RuntimeError if the engine takes no more requests."""
        raise NotImplementedError

    def _open(self, request: GenerationRequest, queue: asyncio.Queue) -> None:
        """Send `request` to the engine, its deltas to go to `queue` (on the running loop)."""
        raise NotImplementedError

    def _submit(self, command: tuple) -> None:
        raise NotImplementedError

    def _check_not_active(self, request_id: str) -> None:
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")


class RequestStream:
    """One request's deltas from a `StreamingEngineClient` (the `DeltaStream` protocol): sent to
    the engine at `open()` or at the first iteration. Leaving before the last delta (`aclose()`,
    a cancelled wait, or dropping the stream) aborts the request.

    Deltas that have piled up while the reader was busy come out as one (`merge_deltas`): a
    server whose event loop falls behind the engines (several replicas' steps to stream) then
    writes one chunk for several tokens instead of falling further behind. A reader that keeps
    up gets every step's delta as it was; nothing ever waits to be merged."""

    def __init__(self, client: StreamingEngineClient, request: GenerationRequest):
        self._client = client
        self.request = request
        self._queue: DeltaQueue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False

    def open(self) -> None:
        """Send the request now (on the running event loop). Idempotent."""
        if self._queue is not None or self._done:
            return
        client, request_id = self._client, self.request.request_id
        client._check_not_active(request_id)
        client._active.add(request_id)
        self._loop = asyncio.get_running_loop()
        self._queue = DeltaQueue(client, request_id)
        try:
            client._open(self.request, self._queue)
        except BaseException:  # not sent: nothing to abort, and the id is free again
            client._active.discard(request_id)
            self._done = True
            raise

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        self.open()
        try:
            delta = await self._queue.get()
        except BaseException:  # cancelled while waiting: nobody reads the rest
            self._abandon()
            raise
        while delta.finish_reason is None and not self._queue.empty():
            delta = merge_deltas(delta, self._queue.get_nowait())
        if delta.finish_reason is not None:
            self._done = True
            self._client._active.discard(self.request.request_id)
        return delta

    async def aclose(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        if self._queue is not None and not self._done:
            _abandon_request(self._queue)
        self._done = True

    def __del__(self) -> None:
        # Opened, then dropped unfinished (a response that never started streaming): an async
        # generator would have been closed by the event loop's finaliser; this is the same net.
        # The abort goes through the loop: a garbage collection can run this inside the client's
        # own `_submit`, under the lock it would take.
        if self._queue is not None and not self._done:
            try:
                self._loop.call_soon_threadsafe(_abandon_request, self._queue)
            except Exception:  # the loop is closed (shutdown): nothing is left to abort
                pass


class DeltaQueue(asyncio.Queue):
    """One stream's deltas (filled on its event loop). The engine routes deltas by request id,
    so a stream left early keeps its id taken until the request's last delta has come: a new
    request with that id would otherwise receive the old one's abort."""

    def __init__(self, client: StreamingEngineClient, request_id: str):
        super().__init__()
        self.client, self.request_id = client, request_id
        self.ended = False  # the last delta has come
        self.abandoned = False  # nobody reads the stream any more

    def put_nowait(self, delta: TokenDelta) -> None:
        super().put_nowait(delta)
        if delta.finish_reason is not None:
            self.ended = True
            if self.abandoned:
                self.client._active.discard(self.request_id)


def _abandon_request(queue: DeltaQueue) -> None:
    """Nobody reads this request's stream any more: stop the request; its id is free once the
    engine has ended it."""
    queue.abandoned = True
    if queue.ended:
        queue.client._active.discard(queue.request_id)
    else:
        queue.client._submit(("abort", queue.request_id))


def merge_deltas(first: TokenDelta, then: TokenDelta) -> TokenDelta:
    """One delta for `first` followed by `then` (of the same request): their tokens and
    logprobs in order, the rest (finish, usage counts, error) as of `then`."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return dataclasses.replace(then, token_ids=first.token_ids + then.token_ids, logprobs=logprobs)


def put_deltas(items: list[tuple[asyncio.Queue, TokenDelta]]) -> None:
    """Each delta into its stream's queue (run on the queues' event loop)."""
    for queue, delta in items:
        queue.put_nowait(delta)
