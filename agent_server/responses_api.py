"""`/v1/responses`: create (plain, streamed or background), retrieve (or resume its stream),
delete, cancel, and list input items.

A create request is validated, turned into an `AgentTask` (Harmony prompt, tools, sampling),
and run as a task that writes events into a `ResponseRun`; the HTTP side only reads that log.
Stored responses keep their Harmony conversation so `previous_response_id` continues it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from openai.types.responses import Response as SDKResponse
from openai_harmony import Message, Role
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inference.request import SamplingParams
from schemas.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    ItemReference,
    MessageItem,
    ResponseCreateRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    ToolChoiceBuiltin,
    ToolChoiceFunction,
    ToolChoiceMcp,
)

from .agent_loop import AgentLoop, AgentOutcome, AgentTask
from .auth import request_owner
from .conversation import input_to_messages, messages_from_json, messages_to_json
from .errors import APIError, from_validation_error, not_found
from .harmony import PromptConfig, preamble, render_prompt
from .large_prompts import check_fits, text_chars
from .ownership import visible
from .request_parsing import read_request
from .response_events import TERMINAL_EVENT, ResponseEvents, dump, new_id
from .run_journal import RunJournal
from .runs import ResponseRun
from .sse import sdk_event, sse_response
from .state import ServerState
from .store import StoredResponse
from .tool_registry import ActiveTools, ToolSessions

log = logging.getLogger(__name__)

# Parameters of OpenAI's Responses API this server does not take, and why.
UNSUPPORTED = {
    "conversation": "conversations are not stored here; continue with previous_response_id",
    "prompt": "there are no stored prompt templates here; send instructions and input",
    "top_logprobs": "this server's Responses API does not return logprobs (Chat Completions does)",
}

INPUT_ITEM = TypeAdapter(InputItem)  # a stored item, checked again as the input it is given as

TERMINAL = ("completed", "incomplete", "failed", "cancelled")  # a response's statuses once it has ended

TOOL_CHOICE_NOTES = {
    "required": "You must call one of the available tools before giving your final answer.",
}


@dataclass
class PreparedResponse:
    request: ResponseCreateRequest
    task: AgentTask
    response: SDKResponse  # the snapshot the events will update
    history: list[Message]  # earlier turns (previous_response_id), without system/developer
    new_messages: list[Message]  # this request's input as Harmony messages
    input_items: list[dict[str, Any]]  # this request's input, as /input_items lists it
    function_calls: dict[str, str] = field(default_factory=dict)  # call_id -> name, whole chain
    input_instructions: list[str] = field(default_factory=list)  # system/developer input, whole chain
    mcp_listed: list[str] = field(default_factory=list)  # server labels listed, whole chain
    chain_item_ids: list[str] = field(default_factory=list)  # item ids of the earlier responses of the chain
    owner: str | None = None  # the owner name of the request's API key (auth.py)


# --- create -------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    config = state.config
    body = await read_request(request, ResponseCreateRequest, config.max_request_bytes, unsupported=UNSUPPORTED,
                              max_items={"input": config.max_input_items, "tools": config.max_tools})
    prepared = await prepare(state, body, started, request_owner(request))
    run = start_run(state, prepared)
    if body.stream:
        # The run reaches the engine first (a few task switches, no I/O): the prompt's prefill
        # then overlaps setting up the stream instead of following it.
        await run.engine_started.wait()
        # A background response outlives its stream; a foreground one stops with its reader.
        return sse_response(
            (sdk_event(e) async for e in run.stream()),
            ping_seconds=state.config.sse_ping_seconds,
            on_close=None if body.background else run.cancel,
        )
    if body.background:
        return JSONResponse(dump(run.snapshot))
    await _wait_unless_disconnected(request, run)
    return JSONResponse(dump(run.snapshot))


async def _wait_unless_disconnected(request: Request, run: ResponseRun) -> None:
    """Wait for the run; if the client hangs up first, stop generating for it."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    finished = asyncio.create_task(run.done.wait())
    try:
        await asyncio.wait({watcher, finished}, return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            run.cancel()
            await finished
    finally:
        watcher.cancel()
        finished.cancel()


async def prepare(state: ServerState, req: ResponseCreateRequest, started: float,
                  owner: str | None = None) -> PreparedResponse:
    """Validate what the schema cannot, and build the agent's task and the first snapshot
    (`owner`: whose earlier responses and items it may use)."""
    config, engine = state.config, state.engine
    if not config.serves(req.model):
        raise APIError(f"The model '{req.model}' does not exist; this server serves '{config.model_name}'.",
                       status=404, param="model", code="model_not_found")
    if req.input is None and req.previous_response_id is None:
        raise APIError("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    if req.background and not req.store:
        raise APIError("Background responses must be stored: set store=true.", param="background")
    include = set(req.include or [])
    if "reasoning.encrypted_content" in include:
        raise APIError("'reasoning.encrypted_content' is not supported: this server does not encrypt reasoning. "
                       "Keep responses stored and continue with previous_response_id instead.", param="include")

    items = await _resolve_references(state, req.input_items(), owner)
    _check_item_ids(items)
    history: list[Message] = []
    known_calls: dict[str, str] = {}
    chain_instructions: list[str] = []
    listed_mcp: set[str] = set()
    chain_ids: list[str] = []
    if req.previous_response_id:
        previous = await _previous(state, req.previous_response_id, owner)
        chain_ids = _chain_item_ids(previous)
        _check_item_ids(items, chain_ids)
        _check_calls_answered(previous, items)
        history = messages_from_json(previous.conversation)
        known_calls = dict(previous.function_calls)
        chain_instructions = list(previous.input_instructions)
        listed_mcp = set(previous.mcp_listed) | {o.get("server_label") for o in previous.response.get("output", [])
                                                 if o.get("type") == "mcp_list_tools"}

    active = state.tools.select(req.tools, enabled=req.tool_choice != "none")
    notes = _tool_choice_notes(req)
    _check_mcp_choice(req, active)
    converted = input_to_messages(items, known_calls)
    input_instructions = chain_instructions + converted.instructions
    instructions = "\n\n".join(t for t in [req.instructions, *input_instructions, *notes] if t)
    prompt_config = PromptConfig(
        reasoning_effort=req.effort,
        instructions=instructions or None,
        function_tools=active.function_descriptions(),
        tool_namespaces=active.namespaces(),
        response_format=_response_format(req),
        conversation_start_date=datetime.date.today().isoformat(),
    )
    head, conversation = preamble(prompt_config), history + converted.messages
    auto = req.truncation == "auto"
    # (the least truncation="auto" keeps: from the last user message on)
    kept = conversation[max([i for i, m in enumerate(conversation) if i > 0 and m.author.role == Role.USER],
                            default=0):] if auto else conversation
    check_fits(head + kept, engine.max_model_len, "input", "input")
    prompt = await state.renderer.run(_prompt_for, head, conversation, engine.max_model_len, req.max_output_tokens,
                                      auto, chars=text_chars(head + conversation))
    if len(prompt) >= engine.max_model_len:
        raise APIError(f"The input is {len(prompt)} tokens; this model's context is {engine.max_model_len} tokens.",
                       param="input", code="context_length_exceeded")
    room = engine.max_model_len - len(prompt)
    if req.max_output_tokens is not None and req.max_output_tokens > room:
        raise APIError(f"'max_output_tokens' is too large: the input is {len(prompt)} tokens and this model's "
                       f"context is {engine.max_model_len}, so at most {room} output tokens fit; got "
                       f"{req.max_output_tokens}.", param="max_output_tokens", code="context_length_exceeded")

    response_id = new_id("resp")
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
    )
    container = next((t.container for t in req.tools if t.type == "code_interpreter"), "auto")
    task = AgentTask(
        response_id=response_id,
        prompt=prompt,
        tools=active,
        sampling=sampling,
        max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        include=include,
        container_id=container if isinstance(container, str) and container != "auto" else new_id("cntr"),
        list_mcp_servers=[ns for ns, b in active.mcp.items() if b.label not in listed_mcp],
        started=started,
        tool_timeout=config.tool_timeout,
        parallel_tool_calls=req.parallel_tool_calls,
    )
    return PreparedResponse(
        request=req,
        task=task,
        response=_initial_snapshot(req, response_id, instructions),
        history=history,
        new_messages=converted.messages,
        input_items=listed_input_items(items),
        function_calls={**known_calls, **converted.function_calls},
        input_instructions=input_instructions,
        mcp_listed=sorted(listed_mcp | {b.label for b in active.mcp.values()}),
        chain_item_ids=chain_ids,
        owner=owner,
    )


def _prompt_for(head: list[Message], conversation: list[Message], max_model_len: int,
                max_output_tokens: int | None, auto_truncation: bool) -> list[int]:
    """The prompt's tokens, truncated under truncation="auto" when it does not fit (a worker
    process runs this for a long conversation: see large_prompts)."""
    prompt = render_prompt(head + conversation)
    if auto_truncation and not _fits(prompt, max_model_len, max_output_tokens):
        prompt = _truncated(head, conversation, max_model_len, max_output_tokens) or prompt
    return prompt


def _fits(prompt: list[int], max_model_len: int, max_output_tokens: int | None) -> bool:
    return len(prompt) < max_model_len and (max_output_tokens is None
                                            or len(prompt) + max_output_tokens <= max_model_len)


def _truncated(head: list[Message], conversation: list[Message], max_model_len: int,
               max_output_tokens: int | None) -> list[int] | None:
    """truncation="auto": the prompt without the fewest oldest conversation messages that makes it
    fit (it starts at a user message), or None when even the last user message on does not fit.
    The stored conversation keeps them all."""
    starts = [i for i, m in enumerate(conversation) if i > 0 and m.author.role == Role.USER]
    best, low, high = None, 0, len(starts) - 1
    while low <= high:  # the prompt shrinks as the cut moves later: search for the earliest that fits
        middle = (low + high) // 2
        prompt = render_prompt(head + conversation[starts[middle]:])
        if _fits(prompt, max_model_len, max_output_tokens):
            best, high = prompt, middle - 1
        else:
            low = middle + 1
    return best


async def _previous(state: ServerState, response_id: str, owner: str | None) -> StoredResponse:
    run = _live(state, response_id, owner)
    if run is not None:
        if run.snapshot.status in TERMINAL:  # its last event is out, its record being stored
            await run.done.wait()
        else:
            raise APIError(f"Previous response '{response_id}' is still in progress.",
                           param="previous_response_id", code="previous_response_in_progress")
    record = await state.store.get(response_id)
    if record is None or not visible(record.owner, owner):
        raise not_found("Previous response", response_id, param="previous_response_id")
    if record.status not in ("completed", "incomplete"):
        raise APIError(f"Previous response '{response_id}' has status '{record.status}' and cannot be continued.",
                       param="previous_response_id")
    return record


async def _resolve_references(state: ServerState, items: list[Any], owner: str | None) -> list[Any]:
    """`item_reference` items replaced by the stored items they name."""
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            found = await state.store.find_item(item.id, owner)
            if found is None:
                raise not_found("Item", item.id, param=f"input[{i}].id")
            try:
                item = INPUT_ITEM.validate_python({k: v for k, v in found.items() if v is not None})
            except ValidationError:
                raise APIError(f"Item '{item.id}' cannot be given as input.", param=f"input[{i}].id") from None
        resolved.append(item)
    return resolved


def _check_item_ids(items: list[Any], earlier: Iterable[str] = ()) -> None:
    """Input item ids are unique, and none is one of the `earlier` items (the previous_response_id
    chain's), as OpenAI requires: `/input_items` pages by them, and the model would see an item
    twice."""
    seen = set(earlier)
    for i, item in enumerate(items):
        item_id = getattr(item, "id", None)
        if item_id in seen:
            raise APIError(f"Duplicate item found with id {item_id}. Remove duplicate items from your input and "
                           "try again.", param=f"input[{i}].id")
        if item_id:
            seen.add(item_id)


def _chain_item_ids(record: StoredResponse) -> list[str]:
    """Ids of every input and output item of the chain ending in `record` (a record stored
    before chains kept them gives its own items)."""
    ids = dict.fromkeys(record.chain_item_ids)  # (ordered, and a long chain's lookups stay O(1))
    for item in [*record.input_items, *record.response.get("output", [])]:
        if isinstance(item.get("id"), str):
            ids.setdefault(item["id"])
    return list(ids)


def _check_calls_answered(previous: StoredResponse, items: list[Any]) -> None:
    """A response that ended in function calls continues with their outputs, as in OpenAI (not
    a call the token limit cut short: nobody can run that)."""
    answered = {item.call_id for item in items if isinstance(item, FunctionCallOutputItem)}
    for output in previous.response.get("output", []):
        if (output.get("type") == "function_call" and output.get("status") == "completed"
                and output.get("call_id") not in answered):
            raise APIError(f"No tool output found for function call {output.get('call_id')}.", param="input")


def _check_mcp_choice(req: ResponseCreateRequest, active: ActiveTools) -> None:
    """A tool choice naming an MCP tool names one its server has (and `allowed_tools` keeps)."""
    choice = req.tool_choice
    if not isinstance(choice, ToolChoiceMcp) or not choice.name:
        return
    for binding in active.mcp.values():
        if binding.label == choice.server_label and not any(t.name == choice.name for t in binding.namespace.tools):
            raise APIError(f"Tool choice '{choice.name}' is not a tool of the '{choice.server_label}' server.",
                           param="tool_choice.name")


def _tool_choice_notes(req: ResponseCreateRequest) -> list[str]:
    """Harmony has no forced tool calls; the choice becomes an instruction (and is checked)."""
    choice = req.tool_choice
    if choice == "required" and not req.tools:
        raise APIError("Tool choice 'required' must be specified with 'tools' parameter.", param="tool_choice")
    if isinstance(choice, str):
        return [TOOL_CHOICE_NOTES[choice]] if choice in TOOL_CHOICE_NOTES else []
    if isinstance(choice, ToolChoiceFunction):
        if not any(t.type == "function" and t.name == choice.name for t in req.tools):
            raise APIError(f"Tool choice '{choice.name}' is not one of the functions in 'tools'.",
                           param="tool_choice")
        return [f"You must call the function `{choice.name}`."]
    if isinstance(choice, ToolChoiceBuiltin):
        if choice.type == "web_search":  # not a tool choice type (the SDK's Response cannot hold it)
            raise APIError("Invalid value for 'tool_choice.type': 'web_search'; use 'web_search_preview', which "
                           "chooses the web_search tool as well.", param="tool_choice.type", code="invalid_value")
        wanted = "code_interpreter" if choice.type == "code_interpreter" else "web_search"
        if not any(t.type.startswith(wanted) for t in req.tools):
            raise APIError(f"Tool choice '{choice.type}' is not in 'tools'.", param="tool_choice")
        return ["You must use the python tool." if wanted == "code_interpreter" else "You must use the browser tool."]
    if isinstance(choice, ToolChoiceMcp):
        if not any(t.type == "mcp" and t.server_label == choice.server_label for t in req.tools):
            raise APIError(f"Tool choice server '{choice.server_label}' is not in 'tools'.", param="tool_choice")
        target = f"the tool `{choice.name}` of" if choice.name else "a tool of"
        return [f"You must call {target} the `{choice.server_label}` server."]
    return []


def _response_format(req: ResponseCreateRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text else None
    if isinstance(fmt, TextFormatJsonSchema):
        return {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description}
    if isinstance(fmt, TextFormatJsonObject):
        return {"name": "json_object", "schema": {"type": "object"},
                "description": "Answer with a single JSON object and nothing else."}
    return None


def _initial_snapshot(req: ResponseCreateRequest, response_id: str, instructions: str) -> SDKResponse:
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    text.setdefault("format", {"type": "text"})
    reasoning = {"effort": req.effort}
    if req.reasoning and (req.reasoning.summary or req.reasoning.generate_summary):
        reasoning["summary"] = req.reasoning.summary or req.reasoning.generate_summary
    tool_choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump(exclude_none=True)
    snapshot = {
        "id": response_id,
        "object": "response",
        "created_at": time.time(),
        "model": req.model,
        "status": "queued" if req.background else "in_progress",
        "background": req.background,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "previous_response_id": req.previous_response_id,
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning": reasoning,
        "text": text,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": tool_choice,
        # MCP headers (credentials, often) are neither echoed nor stored, as in OpenAI.
        "tools": [t.model_dump(by_alias=True, exclude_none=True, exclude={"headers"}) for t in req.tools],
        "metadata": req.metadata or {},
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",  # the processing actually used, whatever was asked for
        "usage": None,
        "truncation": req.truncation or "disabled",
    }
    try:
        return SDKResponse.model_validate(snapshot)
    except ValidationError as e:  # a request field our schema let through but a Response cannot hold
        raise from_validation_error(e, snapshot) from None


def listed_input_items(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as `GET /v1/responses/{id}/input_items` returns them, each with an id."""
    listed = []
    for item in items:
        data = item.model_dump(by_alias=True, exclude_none=True)
        if isinstance(item, MessageItem):
            part = "output_text" if item.role == "assistant" else "input_text"
            if isinstance(item.content, str):
                data["content"] = [{"type": part, "text": item.content}]
            for content in data["content"]:
                if content["type"] == "output_text":
                    content.setdefault("annotations", [])  # (required of an output message's text)
            data.setdefault("id", new_id("msg"))
            data.setdefault("status", "completed")
            data["type"] = "message"
        elif isinstance(item, FunctionCallItem):
            data.setdefault("id", new_id("fc"))
            data.setdefault("status", "completed")
        elif isinstance(item, FunctionCallOutputItem):
            data.setdefault("id", new_id("fco"))
            data.setdefault("status", "completed")
        else:
            data.setdefault("id", new_id("item"))
        listed.append(data)
    return listed


# --- running ------------------------------------------------------------------------------


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
        created_at=prepared.response.created_at,
        owner=prepared.owner,
    )


# --- retrieve, delete, cancel, input items ------------------------------------------------


def _live(state: ServerState, response_id: str, owner: str | None) -> ResponseRun | None:
    """The running response of that id, unless it is not stored, was deleted (it is still
    winding down: its task stops generating, then ends without storing it) or is not the
    requester's (`owner`)."""
    run = state.runs.get(response_id)
    return run if run is not None and run.store and not run.deleted and visible(run.owner, owner) else None


async def _stored(state: ServerState, response_id: str, owner: str | None) -> StoredResponse:
    """The stored response of that id; another owner's is a 404, as a missing one."""
    record = await state.store.get(response_id)
    if record is None or not visible(record.owner, owner):
        raise not_found("Response", response_id)
    return record


def _int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(f"Invalid value for '{name}': expected an integer.", param=name, code="invalid_type") from None
    if not low <= value <= high:
        raise APIError(f"Invalid value for '{name}': must be between {low} and {high}.", param=name,
                       code="invalid_value")
    return value


async def retrieve_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    stream = request.query_params.get("stream", "false").lower() == "true"
    owner = request_owner(request)
    run = _live(state, response_id, owner)
    if not stream:
        if run is not None:
            return JSONResponse(dump(run.snapshot))
        return JSONResponse((await _stored(state, response_id, owner)).response)
    starting_after = _int_query(request, "starting_after", -1, -1, 1 << 62)
    if run is not None and run.background:
        return sse_response((sdk_event(e) async for e in run.stream(starting_after)),
                            ping_seconds=state.config.sse_ping_seconds)
    record = None if run is not None else await _stored(state, response_id, owner)
    if record is None or record.events is None:
        raise APIError("Only background responses can be streamed again; this one was not created with "
                       "background=true.", param="stream")

    events = record.events
    if not events or events[-1].get("type") not in TERMINAL_EVENT.values():
        # The server stopped while it ran (the record was then marked failed): what it streamed
        # was not kept, but a stream still ends with the response's terminal event.
        status = record.status if record.status in TERMINAL else "failed"
        events = [*events, {"type": TERMINAL_EVENT[status], "response": record.response,
                            "sequence_number": max(len(events), starting_after + 1)}]

    async def replay():
        for event in events:
            if event["sequence_number"] > starting_after:
                yield sdk_event(event)

    return sse_response(replay(), ping_seconds=state.config.sse_ping_seconds)


async def delete_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    owner = request_owner(request)
    run = _live(state, response_id, owner)
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
    run = _live(state, response_id, owner)
    if run is None:
        record = await _stored(state, response_id, owner)
        if not record.response.get("background"):
            raise APIError("Only responses created with background=true can be cancelled.", param="response_id")
        return JSONResponse(record.response)
    if not run.background:
        raise APIError("Only responses created with background=true can be cancelled.", param="response_id")
    run.cancel()
    await run.done.wait()
    return JSONResponse(dump(run.snapshot))


async def list_input_items(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    limit = _int_query(request, "limit", 20, 1, 100)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError("Invalid value for 'order': must be 'asc' or 'desc'.", param="order", code="invalid_value")
    owner = request_owner(request)
    run = _live(state, response_id, owner)
    items = run.input_items if run is not None else (await _stored(state, response_id, owner)).input_items
    items = list(items) if order == "asc" else list(reversed(items))
    after = request.query_params.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(f"No input item with id '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    })


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
]
