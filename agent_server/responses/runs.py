"""Responses being generated right now: their event logs, tasks, and cancellation.

Every response runs as its own asyncio task writing events into a `ResponseRun`'s log. A
streaming client reads the log as it grows; a non-streaming one waits for the end; a
background response is polled, resumed (`starting_after`) or cancelled through the registry.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from agent_server.ownership import visible

TERMINAL = ("completed", "incomplete", "failed", "cancelled")  # a response's statuses once it has ended


class ResponseRun:
    def __init__(self, response_id: str, background: bool):
        self.response_id = response_id
        self.background = background
        self.events: list[Any] = []  # SDK event objects, sequence_number == index
        self.done = asyncio.Event()
        self.task: asyncio.Task | None = None  # the whole run, storing included
        self.work: asyncio.Task | None = None  # the agent loop: what cancelling stops
        self.deleted = False  # deleted while running: do not store it when it ends
        self.cancel_requested = False  # cancelled (or deleted) before or while the agent loop ran
        self.store = True  # False: never visible through GET (store=false)
        self.owner: str | None = None  # the owner name of the key that created it (auth.py)
        self.input_items: list[dict[str, Any]] = []
        self.keep: Any = None  # takes the record of a store=false response (a WebSocket connection's)
        self.generate = True  # False: it ends with no output (`start_run`)
        self.snapshot: Any = None  # the live Response (ResponseEvents.response)
        # Set once the agent loop has handed its first request to the engine, or the run ended.
        self.engine_started = asyncio.Event()
        self._changed = asyncio.Event()

    def publish(self, event: Any) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = asyncio.Event()

    def finished(self) -> None:
        self.done.set()
        self.engine_started.set()
        self._changed.set()

    async def stream(self, starting_after: int = -1) -> AsyncIterator[Any]:
        """Events with sequence_number > starting_after, live until the run ends."""
        index = starting_after + 1
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done.is_set():
                return
            changed = self._changed
            if index < len(self.events):
                continue
            await changed.wait()

    def cancel(self) -> None:
        """Stop generating. Before the agent loop has started (a background response is stored
        first), the flag keeps it from starting."""
        self.cancel_requested = True
        if self.work is not None and not self.work.done():
            self.work.cancel()


class RunRegistry:
    def __init__(self) -> None:
        self.runs: dict[str, ResponseRun] = {}

    def add(self, run: ResponseRun) -> None:
        self.runs[run.response_id] = run

    def get(self, response_id: str) -> ResponseRun | None:
        return self.runs.get(response_id)

    def live(self, response_id: str, owner: str | None = None) -> ResponseRun | None:
        """The running response of that id, unless it is not stored, was deleted (it is still
        winding down: its task stops generating, then ends without storing it) or is not the
        requester's (`owner`)."""
        run = self.runs.get(response_id)
        return run if run is not None and run.store and not run.deleted and visible(run.owner, owner) else None

    def remove(self, response_id: str) -> None:
        self.runs.pop(response_id, None)

    def stop(self, response_id: str, deleted: bool = False) -> None:
        """Another server asked, through the shared store, to cancel (or delete) a run of ours."""
        run = self.runs.get(response_id)
        if run is None:
            return
        if deleted:
            run.deleted = True
        run.cancel()

    async def cancel_all(self) -> None:
        runs = list(self.runs.values())
        for run in runs:
            run.cancel()
            if run.work is None and run.task is not None:  # not started yet
                run.task.cancel()
        await asyncio.gather(*(r.task for r in runs if r.task is not None), return_exceptions=True)
