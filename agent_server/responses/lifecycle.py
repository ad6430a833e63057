"""A response's run from start to stored record: the agent loop as a task, its events, the store.

`start_run` registers a `ResponseRun` and starts its task; the task runs the agent loop, which
writes the response's events into the run's log (`agent_server/responses/runs.py`), then stores
the record: the response object, its input items and its Harmony conversation, so that
`previous_response_id` continues it. HTTP handlers only read the log.
"""

from __future__ import annotations

import asyncio
import logging

from openai.types.responses import Response as SDKResponse
from openai_harmony import Message

from agent_server.agent.loop import AgentLoop, AgentOutcome
from agent_server.agent.tool_registry import ToolSessions
from agent_server.responses.conversation import messages_to_json
from agent_server.responses.events import ResponseEvents, dump
from agent_server.responses.prepare import PreparedResponse
from agent_server.responses.runs import TERMINAL, ResponseRun
from agent_server.run_journal import RunJournal
from agent_server.state import ServerState
from agent_server.store import StoredResponse

log = logging.getLogger(__name__)


def start_run(state: ServerState, prepared: PreparedResponse) -> ResponseRun:
    req = prepared.request
    run = ResponseRun(prepared.response.id, background=req.background)
    run.store = req.store
    run.snapshot = prepared.response
    run.input_items = prepared.input_items
    run.owner = prepared.owner
    state.runs.add(run)
    run.task = asyncio.create_task(_execute(state, run, prepared))
    return run


async def _execute(state: ServerState, run: ResponseRun, prepared: PreparedResponse) -> None:
    req, response = prepared.request, prepared.response
    # A stored response is written while it runs too, so a crash does not lose it.
    journal = RunJournal(state.store, run, lambda: _record(prepared, run, [], events=False),
                         keep_events=req.background) if req.store else None

    def publish(event) -> None:
        run.publish(event)
        if journal is not None:
            journal.published(event)

    events = ResponseEvents(response, publish)
    sessions = ToolSessions()
    try:
        if req.background:  # stored at once, so it can be polled (and failed if we restart)
            await _store(state, run, _record(prepared, run, []))
        elif journal is not None:  # (written beside the prefill, not before it)
            journal.start()
        events.lifecycle("response.created")
        if req.background:
            events.lifecycle("response.queued")
            response.status = "in_progress"
        events.lifecycle("response.in_progress")
        loop = AgentLoop(state.engine, prepared.task, events, sessions, state.metrics,
                         on_engine_start=run.engine_started.set)
        if run.cancel_requested:  # cancelled before it started: the engine never sees it
            outcome = AgentOutcome(status="cancelled")
        else:
            run.work = asyncio.create_task(loop.run())
            await asyncio.wait({run.work})
            outcome = AgentOutcome(status="cancelled") if run.work.cancelled() else run.work.result()
        if outcome.status == "incomplete":
            response.incomplete_details = SDKResponse.model_validate(
                {**dump(response), "incomplete_details": {"reason": outcome.incomplete_reason}}
            ).incomplete_details
        elif outcome.status == "failed":
            response.error = SDKResponse.model_validate(
                {**dump(response), "error": {"code": "server_error", "message": outcome.error or "failed"}}
            ).error
        events.finish(outcome.status)
        if journal is not None:
            await journal.close()
        if req.store and not run.deleted:
            await _store(state, run, _record(prepared, run, outcome.new_messages, outcome.function_calls))
    except Exception:
        log.exception("response %s could not be finished", response.id)
        if response.status not in TERMINAL:
            response.error = SDKResponse.model_validate(
                {**dump(response), "error": {"code": "server_error", "message": "internal error"}}
            ).error
            events.finish("failed")
        if journal is not None and not run.deleted:  # (what the journal wrote read in_progress)
            await journal.close()
            await asyncio.gather(_store(state, run, _record(prepared, run, [])), return_exceptions=True)
    finally:
        if journal is not None:
            await journal.close()
        await sessions.close()
        run.finished()
        state.runs.remove(run.response_id)


async def _store(state: ServerState, run: ResponseRun, record: StoredResponse) -> None:
    """Store the run's record. A DELETE that came while the write ran may have found nothing to
    delete yet: it wins all the same."""
    await state.store.put(record)
    if run.deleted:
        await state.store.delete(record.id)


def _record(prepared: PreparedResponse, run: ResponseRun, new_messages: list[Message],
            new_calls: dict[str, str] | None = None, events: bool = True) -> StoredResponse:
    """The run's record as it is now (`events=False`: without the events so far, which the
    journal appends on its own)."""
    conversation = prepared.history + prepared.new_messages + new_messages
    return StoredResponse(
        id=prepared.response.id,
        response=dump(prepared.response),
        input_items=prepared.input_items,
        conversation=messages_to_json(conversation),
        function_calls={**prepared.function_calls, **(new_calls or {})},
        input_instructions=prepared.input_instructions,
        mcp_listed=prepared.mcp_listed,
        chain_item_ids=prepared.chain_item_ids,
        events=([dump(e) for e in run.events] if events else []) if prepared.request.background else None,
        created_at=prepared.created,
        owner=prepared.owner,
    )
