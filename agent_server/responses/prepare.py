"""A create request, checked and made ready to run: the Harmony prompt, tools and sampling.

`prepare` validates what the body alone cannot (the `previous_response_id` chain or the
`conversation`, item ids and references, tool choice, the context length), continues the stored
Harmony conversation, and returns the `AgentTask` the run will execute with the response
snapshot it starts from. A prompt past `context_management`'s compaction threshold is marked
for compaction, which the run does first (`PreparedResponse.compaction`).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from openai.types.responses import Response as SDKResponse
from openai.types.responses import Tool as SDKTool
from openai_harmony import Message, Role
from pydantic import BaseModel, TypeAdapter, ValidationError

from agent_server.agent.loop import AgentTask
from agent_server.agent.tool_registry import ActiveTools
from agent_server.errors import APIError, from_validation_error, not_found
from agent_server.harmony import PromptConfig, preamble, render_prompt
from agent_server.large_prompts import check_fits, text_chars
from agent_server.ownership import visible
from agent_server.request_settings import RequestSettings, request_settings
from agent_server.responses.compaction import split_for_compaction
from agent_server.responses.conversation import input_to_messages, messages_from_json
from agent_server.responses.events import new_id
from agent_server.responses.runs import TERMINAL
from agent_server.state import ServerState
from agent_server.store import RUNNING, StoredConversation, StoredResponse, settled
from agent_server.turn_grammar import TurnRules, check_strict_schema, check_text_grammar
from inference.grammar import Grammar
from inference.request import SamplingParams
from schemas.responses import (
    CompactionItem,
    CustomGrammarFormat,
    CustomTool,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    ItemReference,
    MessageItem,
    NamespaceTool,
    ReasoningOptions,
    ResponseCreateRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    ToolChoiceAllowed,
    ToolChoiceBuiltin,
    ToolChoiceCustom,
    ToolChoiceFunction,
    ToolChoiceMcp,
)

# How long a previous response another server runs may take to be stored once it ended.
PREVIOUS_WAIT_SECONDS = 5.0
INPUT_ITEM = TypeAdapter(InputItem)  # a stored item, checked again as the input it is given as
SDK_TOOL = TypeAdapter(SDKTool)


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
    # When it was created, to the microsecond: the store orders by it (`created_at` is whole seconds).
    created: float = field(default_factory=time.time)
    # What the prompt is rendered from, for a run that compacts first: the system and developer
    # messages, the instructions they hold, and whether earlier turns' analysis is kept.
    head: list[Message] = field(default_factory=list)
    instructions: str | None = None
    keep_analysis: bool = False
    # (what to compact, what follows it) when the prompt passed context_management's threshold.
    compaction: tuple[list[Message], list[Message]] | None = None
    conversation: StoredConversation | None = None  # the `conversation` it runs in, as it was then


async def prepare(
    state: ServerState,
    req: ResponseCreateRequest,
    started: float,
    owner: str | None = None,
    *,
    local_responses: Mapping[str, StoredResponse] | None = None,
    counting: bool = False,
) -> PreparedResponse:
    """Validate what the schema cannot, and build the agent's task and the first snapshot.
    `owner`: whose earlier responses and items it may use. `local_responses`: store=false
    responses a `previous_response_id` may name besides the stored ones (those of a WebSocket
    connection). `counting`: only the prompt is wanted (its tokens are counted), so a prompt
    longer than the context is no error."""
    config, engine = state.config, state.engine
    if not config.serves(req.model):
        raise APIError(
            f"The model '{req.model}' does not exist; this server serves '{config.model_name}'.",
            status=404,
            param="model",
            code="model_not_found",
        )
    if req.input is None and req.previous_response_id is None and req.conversation is None:
        raise APIError("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    if req.conversation is not None and req.previous_response_id is not None:
        raise APIError(
            "'previous_response_id' cannot be used together with 'conversation': a conversation "
            "continues from its own items.",
            param="previous_response_id",
        )
    if req.background and not req.store:
        raise APIError("Background responses must be stored: set store=true.", param="background")
    include = set(req.include or [])

    items = await resolve_references(state, req.input_items(), owner)
    check_item_ids(items)
    history: list[Message] = []
    known_calls: dict[str, str] = {}
    chain_instructions: list[str] = []
    listed_mcp: set[str] = set()
    chain_ids: list[str] = []
    stored_conversation = None
    if req.conversation is not None:
        stored_conversation = await _conversation(state, req.conversation_id, owner)
        chain_ids = await _conversation_item_ids(state, stored_conversation)
        check_item_ids(items, chain_ids)
        history, known_calls, chain_instructions, listed_mcp = await _conversation_history(state, stored_conversation)
    if req.previous_response_id:
        previous = await _previous(state, req.previous_response_id, owner, local_responses)
        chain_ids = _chain_item_ids(previous)
        check_item_ids(items, chain_ids)
        _check_calls_answered(previous, items)
        history = messages_from_json(previous.conversation)
        known_calls = dict(previous.function_calls)
        chain_instructions = list(previous.input_instructions)
        listed_mcp = set(previous.mcp_listed) | {
            o.get("server_label") for o in previous.response.get("output", []) if o.get("type") == "mcp_list_tools"
        }

    settings = request_settings(req, items)
    active = state.tools.select(settings.tools, enabled=req.tool_choice != "none")
    _check_tool_choice(req, settings.tools)
    _check_mcp_choice(req, active)
    rules = _turn_rules(req, settings, active, config.harmony_grammar)
    converted = input_to_messages(items, known_calls, **_openers(state, items))
    input_instructions = chain_instructions + converted.instructions
    instructions = "\n\n".join(t for t in [req.instructions, *input_instructions, *settings.notes] if t)
    prompt_config = PromptConfig(
        reasoning_effort=settings.effort,
        instructions=instructions or None,
        function_tools=active.function_descriptions(),
        tool_namespaces=active.namespaces(),
        response_format=settings.response_format,
        conversation_start_date=datetime.date.today().isoformat(),
    )
    head, conversation = preamble(prompt_config), history + converted.messages
    auto = req.truncation == "auto"
    # (the least truncation="auto" keeps: from the last user message on)
    kept = (
        conversation[max([i for i, m in enumerate(conversation) if i > 0 and m.author.role == Role.USER], default=0) :]
        if auto
        else conversation
    )
    check_fits(head + kept, engine.max_model_len, "input", "input")
    prompt = await state.renderer.run(
        _prompt_for,
        head,
        conversation,
        engine.max_model_len,
        req.max_output_tokens,
        auto,
        settings.keep_analysis,
        chars=text_chars(head + conversation),
    )
    why = _why_truncation_did_not_help(head, conversation) if req.truncation == "auto" else ""
    if len(prompt) >= engine.max_model_len and not counting:
        raise APIError(
            f"The input is {len(prompt)} tokens; this model's context is {engine.max_model_len} tokens.{why}",
            param="input",
            code="context_length_exceeded",
        )
    threshold = req.compact_threshold
    compaction = split_for_compaction(conversation) if threshold is not None and len(prompt) > threshold else None
    room = max(engine.max_model_len - len(prompt), 1)
    if req.max_output_tokens is not None and req.max_output_tokens > room:
        raise APIError(
            f"'max_output_tokens' is too large: the input is {len(prompt)} tokens and this model's "
            f"context is {engine.max_model_len}, so at most {room} output tokens fit; got "
            f"{req.max_output_tokens}.{why}",
            param="max_output_tokens",
            code="context_length_exceeded",
        )
    max_output_tokens = config.output_limit(req.max_output_tokens, room)

    response_id = new_id("resp")
    # Logprobs of the answer's tokens when asked for, with `top_logprobs` alternatives each.
    top_logprobs = (req.top_logprobs or 0) if "message.output_text.logprobs" in include else None
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        logprobs=top_logprobs,
    )
    container = next((t.container for t in req.tools if t.type == "code_interpreter"), "auto")
    task = AgentTask(
        response_id=response_id,
        prompt=prompt,
        tools=active,
        sampling=sampling,
        max_output_tokens=max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        include=include,
        container_id=container if isinstance(container, str) and container != "auto" else new_id("cntr"),
        list_mcp_servers=[ns for ns, b in active.mcp.items() if b.label not in listed_mcp],
        started=started,
        tool_timeout=config.tool_timeout,
        parallel_tool_calls=req.parallel_tool_calls,
        seal_reasoning=state.seal.seal if "reasoning.encrypted_content" in include else None,
        top_logprobs=top_logprobs,
        rules=rules,
    )
    return PreparedResponse(
        request=req,
        task=task,
        response=_initial_snapshot(req, response_id, instructions, max_output_tokens),
        history=history,
        new_messages=converted.messages,
        input_items=listed_input_items(items),
        function_calls={**known_calls, **converted.function_calls},
        input_instructions=input_instructions,
        mcp_listed=sorted(listed_mcp | {b.label for b in active.mcp.values()}),
        chain_item_ids=chain_ids,
        head=head,
        instructions=instructions or None,
        keep_analysis=settings.keep_analysis,
        compaction=compaction,
        conversation=stored_conversation,
        owner=owner,
    )


def _openers(state: ServerState, items: list[Any]) -> dict[str, Any]:
    """`ReasoningSeal.open` and `open_summary`, when items need them (the key is read on first use)."""
    openers: dict[str, Any] = {}
    if any(getattr(item, "encrypted_content", None) for item in items if getattr(item, "type", "") == "reasoning"):
        openers["open_reasoning"] = state.seal.open
    if any(isinstance(item, CompactionItem) for item in items):
        openers["open_summary"] = state.seal.open_summary
    return openers


def _prompt_for(
    head: list[Message],
    conversation: list[Message],
    max_model_len: int,
    max_output_tokens: int | None,
    auto_truncation: bool,
    keep_analysis: bool = False,
) -> list[int]:
    """The prompt's tokens, truncated under truncation="auto" when it does not fit (a worker
    process runs this for a long conversation: see large_prompts)."""
    prompt = render_prompt(head + conversation, keep_analysis=keep_analysis)
    if auto_truncation and not _fits(prompt, max_model_len, max_output_tokens):
        prompt = _truncated(head, conversation, max_model_len, max_output_tokens) or prompt
    return prompt


def _fits(prompt: list[int], max_model_len: int, max_output_tokens: int | None) -> bool:
    return len(prompt) < max_model_len and (
        max_output_tokens is None or len(prompt) + max_output_tokens <= max_model_len
    )


def _why_truncation_did_not_help(head: list[Message], conversation: list[Message]) -> str:
    """For the 400 when truncation="auto" still leaves too much: it only drops whole earlier turns."""
    starts = [i for i, m in enumerate(conversation) if i > 0 and m.author.role == Role.USER]
    if not starts:
        return (
            " truncation='auto' could not help: it drops whole earlier turns, oldest first, and this input is a "
            "single turn (it never cuts into the last user message)."
        )
    left = len(render_prompt(head + conversation[starts[-1] :]))
    return (
        f" truncation='auto' dropped every earlier turn, but the last one on its own (from its user message, "
        f"with the instructions and tools) is still {left} tokens."
    )


def _truncated(
    head: list[Message], conversation: list[Message], max_model_len: int, max_output_tokens: int | None
) -> list[int] | None:
    """truncation="auto": the prompt without the fewest oldest conversation messages that makes it
    fit (it starts at a user message), or None when even the last user message on does not fit.
    The stored conversation keeps them all."""
    starts = [i for i, m in enumerate(conversation) if i > 0 and m.author.role == Role.USER]
    best, low, high = None, 0, len(starts) - 1
    while low <= high:  # the prompt shrinks as the cut moves later: search for the earliest that fits
        middle = (low + high) // 2
        prompt = render_prompt(head + conversation[starts[middle] :])
        if _fits(prompt, max_model_len, max_output_tokens):
            best, high = prompt, middle - 1
        else:
            low = middle + 1
    return best


async def _previous(
    state: ServerState,
    response_id: str,
    owner: str | None = None,
    local_responses: Mapping[str, StoredResponse] | None = None,
) -> StoredResponse:
    if local_responses is not None and response_id in local_responses:
        return local_responses[response_id]
    run = state.runs.live(response_id, owner)
    if run is not None:
        if run.snapshot.status in TERMINAL:  # its last event is out, its record being stored
            await run.done.wait()
        else:
            raise APIError(
                f"Previous response '{response_id}' is still in progress.",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
    record = await state.store.get(response_id, events=False)
    if record is not None and record.status in RUNNING and run is None and visible(record.owner, owner):
        # Another server runs it (a shared store): its last event may be out, its record on its way.
        record = await settled(state.store, response_id, PREVIOUS_WAIT_SECONDS)
        if record is not None and record.status in RUNNING:
            raise APIError(
                f"Previous response '{response_id}' is still in progress.",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
    if record is None or not visible(record.owner, owner):
        raise APIError(
            f"Previous response with id '{response_id}' not found.",
            status=404,
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if record.status not in ("completed", "incomplete"):
        raise APIError(
            f"Previous response '{response_id}' has status '{record.status}' and cannot be continued.",
            param="previous_response_id",
        )
    return record


async def _conversation(state: ServerState, conversation_id: str, owner: str | None) -> StoredConversation:
    """The conversation of that id; another owner's is a 404, as a missing one."""
    found = await state.store.get_conversation(conversation_id)
    if found is None or not visible(found.owner, owner):
        raise not_found("Conversation", conversation_id, param="conversation")
    return found


async def _conversation_item_ids(state: ServerState, conversation: StoredConversation) -> list[str]:
    items = await state.store.conversation_items(conversation.id) or []
    return [item["id"] for item in items]


async def _conversation_history(
    state: ServerState, conversation: StoredConversation
) -> tuple[list[Message], dict[str, str], list[str], set[str]]:
    """(Harmony messages, call names, instructions, listed MCP servers) a response in the
    conversation continues from: what its last response left, while no item was added or
    deleted since; otherwise its items, converted as input is."""
    saved = conversation.current_state
    if saved is not None:
        return (
            messages_from_json(saved["conversation"]),
            dict(saved["function_calls"]),
            list(saved["input_instructions"]),
            set(saved["mcp_listed"]),
        )
    stored = await state.store.conversation_items(conversation.id) or []
    items = []
    for item in stored:
        try:
            items.append(INPUT_ITEM.validate_python({k: v for k, v in item.items() if v is not None}))
        except ValidationError:
            raise APIError(
                f"Item '{item.get('id')}' of conversation '{conversation.id}' cannot be given to the model.",
                param="conversation",
            ) from None
    converted = input_to_messages(items, {}, **_openers(state, items))
    listed = {item.get("server_label") for item in stored if item.get("type") == "mcp_list_tools"}
    return converted.messages, converted.function_calls, converted.instructions, listed


async def resolve_references(state: ServerState, items: list[Any], owner: str | None = None) -> list[Any]:
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


def check_item_ids(items: list[Any], earlier: Iterable[str] = ()) -> None:
    """Input item ids are unique, and none is one of the `earlier` items (the previous_response_id
    chain's), as OpenAI requires: `/input_items` pages by them, and the model would see an item
    twice."""
    seen = set(earlier)
    for i, item in enumerate(items):
        item_id = getattr(item, "id", None)
        if item_id in seen:
            raise APIError(
                f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try again.",
                param=f"input[{i}].id",
            )
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
        if (
            output.get("type") == "function_call"
            and output.get("status") == "completed"
            and output.get("call_id") not in answered
        ):
            raise APIError(f"No tool output found for function call {output.get('call_id')}.", param="input")


def _check_mcp_choice(req: ResponseCreateRequest, active: ActiveTools) -> None:
    """A tool choice naming an MCP tool names one its server has (and `allowed_tools` keeps)."""
    choice = req.tool_choice
    if not isinstance(choice, ToolChoiceMcp) or not choice.name:
        return
    for binding in active.mcp.values():
        if binding.label == choice.server_label and not any(t.name == choice.name for t in binding.namespace.tools):
            raise APIError(
                f"Tool choice '{choice.name}' is not a tool of the '{choice.server_label}' server.",
                param="tool_choice.name",
            )


def _check_tool_choice(req: ResponseCreateRequest, tools: list[Any]) -> None:
    """A tool choice names a tool of `tools` (the turn grammar then forces the call)."""
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceAllowed):
        choice = "required" if choice.mode == "required" else "auto"
    if choice == "required" and not tools:
        raise APIError("Tool choice 'required' must be specified with 'tools' parameter.", param="tool_choice")
    if isinstance(choice, (ToolChoiceFunction, ToolChoiceCustom)):
        if not any(t.type == choice.type and t.name == choice.name for t in tools):
            raise APIError(
                f"Tool choice '{choice.name}' is not one of the {choice.type} tools in 'tools'.", param="tool_choice"
            )
    elif isinstance(choice, ToolChoiceBuiltin):
        if choice.type == "web_search":  # not a tool choice type (the SDK's Response cannot hold it)
            raise APIError(
                "Invalid value for 'tool_choice.type': 'web_search'; use 'web_search_preview', which "
                "chooses the web_search tool as well.",
                param="tool_choice.type",
                code="invalid_value",
            )
        wanted = "code_interpreter" if choice.type == "code_interpreter" else "web_search"
        if not any(t.type.startswith(wanted) for t in tools):
            raise APIError(f"Tool choice '{choice.type}' is not in 'tools'.", param="tool_choice")
    elif isinstance(choice, ToolChoiceMcp):
        if not any(t.type == "mcp" and t.server_label == choice.server_label for t in tools):
            raise APIError(f"Tool choice server '{choice.server_label}' is not in 'tools'.", param="tool_choice")


def _turn_rules(
    req: ResponseCreateRequest, settings: RequestSettings, active: ActiveTools, structure: bool
) -> TurnRules | None:
    """What the turn grammar holds this response's turns to (`agent_server/turn_grammar.py`):
    every turn's Harmony structure where `structure` is on, and in any case what the request
    asks to be enforced (a strict answer format or function, a forced tool); None: nothing."""
    answer = _answer_schema(settings.text_format)
    strict = False
    for tool, param in _function_tools(req, settings.tools):
        if tool.strict and tool.parameters is not None:
            strict = True
            error = check_strict_schema(tool.parameters)
            if error:
                raise APIError(
                    f"Invalid schema for function '{tool.name}': {error}",
                    param=param,
                    code="invalid_function_parameters",
                )
    for tool, param in _client_tools(req, settings.tools, CustomTool, "format.definition"):
        if isinstance(tool.format, CustomGrammarFormat):
            error = check_text_grammar(Grammar(tool.format.syntax, tool.format.definition))
            if error:
                raise APIError(
                    f"Invalid {tool.format.syntax} grammar for custom tool '{tool.name}': {error}",
                    param=param,
                    code="invalid_value",
                )
    forced = active.forced_targets(req.tool_choice)
    calls = active.call_targets()
    grammars = any(t.grammar is not None for t in calls)  # a custom tool's input is held to its grammar
    if not (structure or forced or answer is not None or strict or grammars):
        return None
    return TurnRules(calls, forced, answer, parallel_calls=req.parallel_tool_calls)


def _function_tools(req: ResponseCreateRequest, tools: list[Any]) -> Iterable[tuple[FunctionTool, str]]:
    """The function tools among `tools` (a namespace's too), each with the parameter naming its
    schema (`input` for one an input item added)."""
    return _client_tools(req, tools, FunctionTool, "parameters")


def _client_tools(req: ResponseCreateRequest, tools: list[Any], kind: type, field: str) -> Iterable[tuple[Any, str]]:
    """The tools of type `kind` among `tools` (a namespace's too), each with the parameter naming
    its `field` (`input` for one an input item added)."""
    for tool in tools:
        i = next((k for k, t in enumerate(req.tools) if t is tool), None)
        where = f"tools[{i}]" if i is not None else "input"
        if isinstance(tool, kind):
            yield tool, f"{where}.{field}" if i is not None else where
        elif isinstance(tool, NamespaceTool):
            for k, inner in enumerate(tool.tools):
                if isinstance(inner, kind):
                    yield inner, f"{where}.tools[{k}].{field}" if i is not None else where


def _answer_schema(fmt: Any) -> dict[str, Any] | None:
    """The schema a strict `json_schema` format (or `json_object`) holds the answer to."""
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "object"}
    if isinstance(fmt, TextFormatJsonSchema) and fmt.strict:
        error = check_strict_schema(fmt.schema_)
        if error:
            raise APIError(
                f"Invalid schema for response_format '{fmt.name}': {error}",
                param="text.format.schema",
                code="invalid_json_schema",
            )
        return fmt.schema_
    return None


def _initial_snapshot(
    req: ResponseCreateRequest, response_id: str, instructions: str, max_output_tokens: int | None
) -> SDKResponse:
    """max_output_tokens: the limit the response runs under (the request's, or the server's default)."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    text.setdefault("format", {"type": "text"})
    text.setdefault("verbosity", "medium")
    asked = req.reasoning or ReasoningOptions()
    # The effort asked for (gpt-oss runs it at `req.effort`); no summary is ever written (docs/api.md).
    reasoning = {"effort": asked.effort or "medium", "summary": asked.summary or asked.generate_summary}
    tool_choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump(exclude_none=True)
    snapshot = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),  # whole seconds, as OpenAI's
        "completed_at": None,
        "model": req.model,
        "status": "queued" if req.background else "in_progress",
        "background": req.background,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "previous_response_id": req.previous_response_id,
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning": reasoning,
        "text": text,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": tool_choice,
        "tools": [echoed_tool(t) for t in req.tools],
        "metadata": req.metadata or {},
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention,
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",  # the processing actually used, whatever was asked for
        "usage": None,
        "truncation": req.truncation or "disabled",
        "store": req.store,
        "top_logprobs": req.top_logprobs or 0,
        # Not in the SDK's Response type, but in OpenAI's responses: no penalties in this API.
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "conversation": {"id": req.conversation_id} if req.conversation is not None else None,
    }
    try:
        return SDKResponse.model_validate(snapshot)
    except ValidationError as e:  # a request field our schema let through but a Response cannot hold
        raise from_validation_error(e, snapshot) from None


def echoed_tool(tool: Any) -> dict[str, Any]:
    """A request tool as the response echoes it: every field of OpenAI's tool object, null where
    not given (a function's `strict` too), but MCP headers and authorization (credentials,
    often), which OpenAI neither echoes nor stores."""
    data = tool.model_dump(by_alias=True, exclude={"headers", "authorization"})
    try:
        return _declared(data, SDK_TOOL.validate_python(data))
    except ValidationError:  # the snapshot's validation names what is wrong with it (a 400)
        return data


def _declared(data: Any, sdk: Any) -> Any:
    """`data` without the nulls of fields the SDK's type of it does not declare (our request
    models take every alias of a tool type, whose fields differ)."""
    if isinstance(data, list) and isinstance(sdk, list):
        return [_declared(d, s) for d, s in zip(data, sdk, strict=False)]
    if not (isinstance(data, dict) and isinstance(sdk, BaseModel)):
        return data
    fields = {f.alias or name: name for name, f in type(sdk).model_fields.items()}
    return {
        key: _declared(value, getattr(sdk, fields[key], None)) if key in fields else value
        for key, value in data.items()
        if key in fields or value is not None
    }


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
