"""A stored response written to the store while it runs, so that a crash loses none of what
its client was told: the id it holds reads `failed` after a restart, with the output
generated until shortly before the crash, and a background response's stream replays the
events it had sent, with their sequence numbers.

`RunJournal` writes the run's record (the live snapshot) when the run starts and then at
most every `interval` seconds while events come, and appends a background run's events in
the same writes. One write at a time, off the run's path: the run never waits for the
store, except for the write in flight when it ends (its final record must land last).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from agent_server.responses.events import dump
from agent_server.responses.runs import ResponseRun
from agent_server.store import RUNNING, ResponseStore, StoredResponse

log = logging.getLogger(__name__)


class RunJournal:
    def __init__(
        self,
        store: ResponseStore,
        run: ResponseRun,
        record: Callable[[], StoredResponse],
        *,
        keep_events: bool,
        interval: float = 0.5,
    ):
        self.store = store
        self.run = run
        self.record = record  # the run's record as it is now (without its events)
        self.keep_events = keep_events
        self.interval = interval
        self._events: list[dict[str, Any]] = []  # published since the last write
        self._dirty = False
        self._task: asyncio.Task | None = None
        self._writing = False
        self._closed = False

    def start(self) -> None:
        """The first write, at once (the record exists from the start)."""
        self._dirty = True
        self._task = asyncio.create_task(self._write())

    def published(self, event: Any) -> None:
        if self._closed:
            return
        if self.keep_events:
            self._events.append(dump(event))
        self._dirty = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write_soon())

    async def _write_soon(self) -> None:
        await asyncio.sleep(self.interval)
        await self._write()

    async def _write(self) -> None:
        self._writing = True
        try:
            while self._dirty and not self._closed and not self.run.deleted:
                self._dirty = False
                events, self._events = self._events, []
                if events:
                    await self.store.append_events(self.run.response_id, events)
                record = self.record()
                # A record that has ended while this write ran is the run's final write to make,
                # with all its events: stored here, it would read ended without its last events
                # (a stream followed on another server would end early).
                if record.status in RUNNING:
                    await self.store.put(record)
                if self.run.deleted:  # a DELETE that came while the write ran wins all the same
                    await self.store.delete(self.run.response_id)
        except Exception:  # the run goes on; its final record is written when it ends
            log.exception("writing response %s while it runs", self.run.response_id)
        finally:
            self._writing = False

    async def close(self) -> None:
        """No more writes: the one in flight finishes first (the run's final record follows)."""
        self._closed = True
        task = self._task
        if task is None or task.done():
            return
        if not self._writing:
            task.cancel()  # (still waiting for its interval)
        await asyncio.gather(task, return_exceptions=True)
