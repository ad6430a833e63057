"""A response's run from start to stored record: the agent loop as a task, its events, the store.

`start_run` registers a `ResponseRun` and starts its task; the task runs the agent loop, which
writes the response's events into the run's log (`agent_server/responses/runs.py`), then stores
the record: the response object, its input items and its Harmony conversation, so that
`previous_response_id` continues it (a store=false response's record goes to the run's `keep`,
a WebSocket connection's memory, if it has one). A response in a `conversation` adds its input
and output items to it. A prompt past the compaction threshold is compacted before the agent
loop starts. HTTP handlers only read the log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from openai.types.responses import Response as SDKResponse
from openai_harmony import Message

from agent_server.agent.loop import AgentLoop, AgentOutcome
from agent_server.agent.tool_registry import ToolSessions
from agent_server.errors import APIError
from agent_server.harmony import render_prompt
from agent_server.responses.compaction import CompactionFailed, CompactionWriter, compacted, summarise
from agent_server.responses.conversation import messages_to_json
from agent_server.responses.events import ResponseEvents, dump
from agent_server.responses.prepare import PreparedResponse
from agent_server.responses.runs import TERMINAL, ResponseRun
from agent_server.run_journal import RunJournal
from agent_server.state import ServerState
from agent_server.store import StoredResponse

log = logging.getLogger(__name__)


def start_run(
    state: ServerState,
    prepared: PreparedResponse,
    keep: Callable[[StoredResponse], None] | None = None,
    generate: bool = True,
) -> ResponseRun:
    """`keep`: takes the record of a store=false response that can be continued. `generate`
    False: the response ends at once with no output, a conversation to continue (a client's
    prewarm, over a WebSocket)."""
    req = prepared.request
    run = ResponseRun(prepared.response.id, background=req.background)
    run.keep = keep
    run.generate = generate
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
    journal = (
        RunJournal(state.store, run, lambda: _record(prepared, run, [], events=False), keep_events=req.background)
        if req.store
        else None
    )

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
        if run.cancel_requested:  # cancelled before it started: the engine never sees it
            outcome = AgentOutcome(status="cancelled")
        elif not run.generate:
            outcome = AgentOutcome(status="completed")
            run.engine_started.set()
        else:
            run.work = asyncio.create_task(_work(state, run, prepared, events, sessions))
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
        record = None
        if req.store and not run.deleted:
            record = _record(prepared, run, outcome.new_messages, outcome.function_calls)
            await _store(state, run, record)
        continued = outcome.status in ("completed", "incomplete")
        if run.keep is not None and not req.store and continued:
            record = _record(prepared, run, outcome.new_messages, outcome.function_calls)
            run.keep(record)
        if prepared.conversation is not None and continued:
            await _add_to_conversation(
                state, prepared, record or _record(prepared, run, outcome.new_messages, outcome.function_calls)
            )
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


async def _work(
    state: ServerState, run: ResponseRun, prepared: PreparedResponse, events: ResponseEvents, sessions: ToolSessions
) -> AgentOutcome:
    """The agent loop, after compacting the conversation when the prompt passed the threshold."""
    summary_usage = None
    if prepared.compaction is not None:
        run.engine_started.set()  # (a stream starts with the compaction's events)
        try:
            summary_usage = await _compact_first(state, prepared, events)
        except CompactionFailed:
            return AgentOutcome(status="failed", error="The conversation could not be compacted.")
        except APIError as e:  # no room left to write the summary in
            return AgentOutcome(status="failed", error=e.message)
    loop = AgentLoop(
        state.engine, prepared.task, events, sessions, state.metrics, on_engine_start=run.engine_started.set
    )
    outcome = await loop.run()
    if summary_usage is not None:  # the summary's tokens count, as the response's own do
        usage = dump(events.response.usage)
        usage["input_tokens"] += summary_usage["input"]
        usage["input_tokens_details"]["cached_tokens"] += summary_usage["cached"]
        usage["output_tokens"] += summary_usage["output"]
        usage["output_tokens_details"]["reasoning_tokens"] += summary_usage["reasoning"]
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        events.response.usage = type(events.response.usage).model_validate(usage)
    return outcome


async def _compact_first(state: ServerState, prepared: PreparedResponse, events: ResponseEvents) -> dict[str, int]:
    """Summarise what comes before the message being answered into the response's first output
    item; the response then runs, and is stored, on the compacted conversation."""
    older, rest = prepared.compaction
    writer = CompactionWriter(events)
    summary = await summarise(
        state.engine,
        older,
        prepared.instructions,
        f"{prepared.response.id}/compaction",
        max_tokens=state.config.default_max_output_tokens,
        metrics=state.metrics,
    )
    writer.done(state.seal.seal_summary(summary.text))
    prepared.history, prepared.new_messages = compacted(older, summary.text), rest
    prepared.task.prompt = render_prompt(prepared.head + prepared.history + rest, keep_analysis=prepared.keep_analysis)
    return summary.usage


async def _add_to_conversation(state: ServerState, prepared: PreparedResponse, record: StoredResponse) -> None:
    """The response's input and output items join its conversation; what the model saw becomes
    the conversation's state, unless its items changed while the response ran."""
    conversation = prepared.conversation
    saved = {
        "conversation": record.conversation,
        "function_calls": record.function_calls,
        "input_instructions": record.input_instructions,
        "mcp_listed": record.mcp_listed,
    }
    try:
        added = await state.store.add_conversation_items(
            conversation.id,
            [*record.input_items, *record.response.get("output", [])],
            saved,
            from_version=conversation.version,
        )
    except ValueError as e:  # an item id it took meanwhile (given twice by concurrent responses)
        log.warning("response %s: its items were not added to conversation %s: %s", record.id, conversation.id, e)
        return
    if added is None:
        log.info("response %s: conversation %s was deleted while it ran", record.id, conversation.id)


async def _store(state: ServerState, run: ResponseRun, record: StoredResponse) -> None:
    """Store the run's record. A DELETE that came while the write ran may have found nothing to
    delete yet: it wins all the same."""
    await state.store.put(record)
    if run.deleted:
        await state.store.delete(record.id)


def _record(
    prepared: PreparedResponse,
    run: ResponseRun,
    new_messages: list[Message],
    new_calls: dict[str, str] | None = None,
    events: bool = True,
) -> StoredResponse:
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
