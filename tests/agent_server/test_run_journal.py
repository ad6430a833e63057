"""`RunJournal`: a running response's record written while it runs, never ended before its
final write (which carries all its events)."""

from __future__ import annotations

import asyncio

from agent_server.responses.runs import ResponseRun
from agent_server.run_journal import RunJournal
from agent_server.store import StoredResponse


class GatedStore:
    """Records what is written; `append_events` waits for `gate` (a slow database)."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.puts: list[str | None] = []
        self.appended: list[int] = []

    async def append_events(self, response_id, events):
        await self.gate.wait()
        self.appended += [e["sequence_number"] for e in events]

    async def put(self, record):
        self.puts.append(record.status)

    async def delete(self, response_id):
        return True


class Event:
    """An event as the run publishes it (an SDK model: `dump` calls model_dump)."""

    def __init__(self, **fields):
        self.fields = fields

    def model_dump(self, **_):
        return dict(self.fields)


def record_with(status: str) -> StoredResponse:
    return StoredResponse(id="resp_1", response={"id": "resp_1", "status": status}, input_items=[], events=[])


def test_a_run_that_ends_while_a_write_is_in_flight_is_not_stored_ended_by_the_journal():
    async def go():
        store = GatedStore()
        run = ResponseRun("resp_1", background=True)
        status = {"now": "in_progress"}
        journal = RunJournal(store, run, lambda: record_with(status["now"]), keep_events=True, interval=0)
        journal.start()
        await asyncio.sleep(0)
        journal.published(Event(type="response.output_text.delta", sequence_number=0))
        await asyncio.sleep(0.01)  # the write is in flight, held in append_events
        status["now"] = "completed"  # the run ends meanwhile (its last events not yet written)
        store.gate.set()
        await journal.close()
        # The journal stored it running (the first write), never completed: the final write
        # (the run's, with every event) is the one that says it ended.
        assert store.puts and all(s == "in_progress" for s in store.puts), store.puts
        assert store.appended == [0]

    asyncio.run(go())
