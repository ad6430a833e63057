"""`/v1/responses`: create (plain, streamed or background), retrieve (or resume its stream),
delete, cancel, list input items; compact a conversation, count a prompt's tokens. (The
WebSocket transport of create is `agent_server/responses/websocket.py`.)

A create request is validated, turned into an `AgentTask` (Harmony prompt, tools, sampling),
and run as a task that writes events into a `ResponseRun`; the HTTP side only reads that log.
Stored responses keep their Harmony conversation so `previous_response_id` continues it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent_server.auth import request_owner
from agent_server.errors import APIError, not_found
from agent_server.ownership import visible
from agent_server.request_parsing import int_query, read_request
from agent_server.responses import dialect
from agent_server.responses.compaction import compaction_item, kept_items, summarise, usage_json
from agent_server.responses.events import TERMINAL_EVENT, dump, new_id
from agent_server.responses.lifecycle import start_run
from agent_server.responses.prepare import prepare
from agent_server.responses.runs import TERMINAL, ResponseRun
from agent_server.sse import sdk_event, sse_response
from agent_server.state import ServerState
from agent_server.store import RUNNING, StoredResponse, settled
from schemas.responses import (
    InputTokensRequest,
    ResponseCompactRequest,
    ResponseCreateRequest,
)

log = logging.getLogger(__name__)

# How long a cancel waits for the server that runs the response (another one) to stop it.
CANCEL_WAIT_SECONDS = 30.0

# Parameters of OpenAI's Responses API this server does not take, and why.
UNSUPPORTED = {
    "prompt": "there are no stored prompt templates here; send instructions and input",
    "moderation": "this server runs no moderation model",
}


# --- create -------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    config = state.config
    body = await read_request(
        request,
        ResponseCreateRequest,
        config.max_request_bytes,
        unsupported=UNSUPPORTED,
        max_items={"input": config.max_input_items, "tools": config.max_tools},
    )
    prepared = await prepare(state, body, started, request_owner(request))
    run = start_run(state, prepared)
    if body.stream:
        # The run reaches the engine first (a few task switches, no I/O): the prompt's prefill
        # then overlaps setting up the stream instead of following it.
        await run.engine_started.wait()
        # A background response outlives its stream; a foreground one stops with its reader.
        spoken = dialect.of(request.scope)
        return sse_response(
            (sdk_event(dialect.written(e, spoken)) async for e in run.stream()),
            ping_seconds=state.config.sse_ping_seconds,
            on_close=None if body.background else run.cancel,
        )
    if body.background:
        return JSONResponse(dump(run.snapshot))
    await _wait_unless_disconnected(request, run)
    return JSONResponse(dump(run.snapshot))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _wait_unless_disconnected(request: Request, run: ResponseRun) -> None:
    """Wait for the run; if the client hangs up first, stop generating for it."""
    watcher = asyncio.create_task(_disconnected(request))
    finished = asyncio.create_task(run.done.wait())
    try:
        await asyncio.wait({watcher, finished}, return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            run.cancel()
            await finished
    finally:
        watcher.cancel()
        finished.cancel()


# --- compact, count ------------------------------------------------------------------------


async def compact_response(request: Request) -> Response:
    """The conversation (`previous_response_id`'s, then `input`) summarised by the model into a
    compaction item, after the messages a compaction keeps (`responses/compaction.py`)."""
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    config = state.config
    body = await read_request(
        request, ResponseCompactRequest, config.max_request_bytes, max_items={"input": config.max_input_items}
    )
    create = ResponseCreateRequest(
        model=body.model,
        input=body.input,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        store=False,
    )
    prepared = await prepare(state, create, started, request_owner(request))
    conversation = prepared.history + prepared.new_messages
    compaction_id = new_id("resp")
    work = asyncio.create_task(
        summarise(
            state.engine,
            conversation,
            prepared.instructions,
            f"{compaction_id}/compaction",
            max_tokens=config.default_max_output_tokens,
            metrics=state.metrics,
        )
    )
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():  # the client hung up: stop writing the summary
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():  # nobody is left to answer
        raise APIError("The client disconnected before the compaction ended.", code="client_disconnected")
    summary = work.result()
    return JSONResponse(
        {
            "id": compaction_id,
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": [
                *kept_items(prepared.input_instructions, conversation),
                compaction_item(state.seal.seal_summary, summary.text),
            ],
            "usage": usage_json(summary.usage),
        }
    )


async def count_input_tokens(request: Request) -> Response:
    """The tokens of the prompt a create request with these parameters would run on."""
    state: ServerState = request.app.state.server
    config = state.config
    body = await read_request(
        request,
        InputTokensRequest,
        config.max_request_bytes,
        max_items={"input": config.max_input_items, "tools": config.max_tools},
    )
    prepared = await prepare(
        state, body.create_request(config.model_name), time.perf_counter(), request_owner(request), counting=True
    )
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prepared.task.prompt)})


# --- retrieve, delete, cancel, input items ------------------------------------------------


async def _stored(state: ServerState, response_id: str, owner: str | None) -> StoredResponse:
    """The stored response of that id; another owner's is a 404, as a missing one."""
    record = await state.store.get(response_id)
    if record is None or not visible(record.owner, owner):
        raise not_found("Response", response_id)
    return record


async def retrieve_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    stream = request.query_params.get("stream", "false").lower() == "true"
    owner = request_owner(request)
    run = state.runs.live(response_id, owner)
    if not stream:
        if run is not None:
            return JSONResponse(dump(run.snapshot))
        return JSONResponse((await _stored(state, response_id, owner)).response)
    starting_after = int_query(request, "starting_after", -1, -1, 1 << 62)
    spoken = dialect.of(request.scope)
    if run is not None and run.background:
        return sse_response(
            (sdk_event(dialect.written(e, spoken)) async for e in run.stream(starting_after)),
            ping_seconds=state.config.sse_ping_seconds,
        )
    record = None if run is not None else await _stored(state, response_id, owner)
    if record is None or record.events is None:
        raise APIError(
            "Only background responses can be streamed again; this one was not created with background=true.",
            param="stream",
        )
    if record.status in RUNNING and not _ends(record.events):  # another server runs it (a shared store)
        return sse_response(_follow(state, record, starting_after, spoken), ping_seconds=state.config.sse_ping_seconds)

    events = _with_terminal_event(record, record.events, starting_after)

    async def replay():
        for event in events:
            if event["sequence_number"] > starting_after:
                yield sdk_event(dialect.written(event, spoken))

    return sse_response(replay(), ping_seconds=state.config.sse_ping_seconds)


def _ends(events: list[dict]) -> bool:
    return bool(events) and events[-1].get("type") in TERMINAL_EVENT.values()


def _with_terminal_event(record: StoredResponse, events: list[dict], starting_after: int) -> list[dict]:
    """A stored response's events, ending with its terminal event: when the server running it
    stopped (the record was then marked failed), what it streamed since its last write was not
    kept, but a stream still ends with the response's terminal event."""
    if _ends(events):
        return events
    status = record.status if record.status in TERMINAL else "failed"
    last = events[-1]["sequence_number"] if events else -1
    terminal = {"type": TERMINAL_EVENT[status], "response": record.response}
    return [*events, {**terminal, "sequence_number": max(last + 1, starting_after + 1)}]


async def _follow(state: ServerState, record: StoredResponse, starting_after: int, spoken: str):
    """The events of a background response another server runs: those stored, then those its
    owner appends, until its terminal event (or its record ends otherwise: its owner died), each
    written in the request's dialect (`spoken`), as the owner's own stream would be."""
    after = starting_after
    events = record.events or []
    while True:
        for event in events:
            if event["sequence_number"] > after:
                after = event["sequence_number"]
                yield sdk_event(dialect.written(event, spoken))
                if event.get("type") in TERMINAL_EVENT.values():
                    return
        await state.store.changed(record.id, 0.5)
        current = await state.store.get(record.id, events=False)  # (its status first: then its events are all in)
        events = await state.store.events_after(record.id, after)
        if current is None:  # deleted meanwhile
            return
        if current.status not in RUNNING:
            events = _with_terminal_event(current, events, after)


async def delete_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    owner = request_owner(request)
    run = state.runs.live(response_id, owner)
    if run is not None:
        run.deleted = True
        run.cancel()
    elif owner is not None:
        await _stored(state, response_id, owner)  # (another owner's: a 404, and left alone)
    deleted = await state.store.delete(response_id)
    if not deleted and run is None:
        raise not_found("Response", response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    owner = request_owner(request)
    run = state.runs.live(response_id, owner)
    if run is None:
        record = await _stored(state, response_id, owner)
        if not record.response.get("background"):
            raise APIError("Only responses created with background=true can be cancelled.", param="response_id")
        if record.status in RUNNING and await state.store.request_cancel(response_id):
            # Another server runs it (a shared store): it stops it and stores it cancelled.
            record = await settled(state.store, response_id, CANCEL_WAIT_SECONDS) or record
        return JSONResponse(record.response)
    if not run.background:
        raise APIError("Only responses created with background=true can be cancelled.", param="response_id")
    run.cancel()
    await run.done.wait()
    return JSONResponse(dump(run.snapshot))


async def list_input_items(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    limit = int_query(request, "limit", 20, 1, 100)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError("Invalid value for 'order': must be 'asc' or 'desc'.", param="order", code="invalid_value")
    owner = request_owner(request)
    run = state.runs.live(response_id, owner)
    items = run.input_items if run is not None else (await _stored(state, response_id, owner)).input_items
    items = list(items) if order == "asc" else list(reversed(items))
    after = request.query_params.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(f"No input item with id '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/compact", compact_response, methods=["POST"]),
    Route("/v1/responses/input_tokens", count_input_tokens, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
]
