"""Chat Completions messages -> a Harmony prompt.

system/developer -> developer instructions; user -> user; assistant -> its earlier reasoning
(`reasoning_content`) on the analysis channel, its text on the final channel and each tool call
as a commentary message to `functions.<name>`; tool -> a tool message from that function.
"""

from __future__ import annotations

import datetime

from openai_harmony import Message, Role, ToolDescription

from agent_server.errors import APIError
from agent_server.harmony import PromptConfig, preamble, render_prompt, tool_message, verbosity_note
from agent_server.responses.conversation import assistant_call
from agent_server.turn_grammar import CallTarget, TurnRules, check_strict_schema, function_arguments
from schemas.chat import (
    AllowedToolsChoice,
    AssistantMessage,
    ChatCompletionRequest,
    ChatCustomTool,
    ChatTool,
    NamedCustomChoice,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SystemMessage,
    ToolMessage,
    UserMessage,
)


def chat_prompt(req: ChatCompletionRequest) -> list[int]:
    """The request's conversation rendered for the assistant's next turn."""
    return render_prompt(chat_messages(req))


def chat_messages(req: ChatCompletionRequest) -> list[Message]:
    """The request's conversation as Harmony messages, the system and developer ones first
    (APIError for messages that do not pair up as OpenAI requires)."""
    instructions: list[str] = []
    messages: list[Message] = []
    call_names: dict[str, str] = {}
    pending: dict[str, str] = {}  # calls of the last assistant message that no tool message answered yet
    pending_at = -1
    answers: dict[str, Message | None] = {}  # tool messages of the pending calls, by call id
    for i, message in enumerate(req.messages):
        if pending and not isinstance(message, ToolMessage):
            _unanswered(pending, pending_at)
        if isinstance(message, SystemMessage):
            instructions.append(message.text())
        elif isinstance(message, UserMessage):
            messages.append(Message.from_role_and_content(Role.USER, message.text()))
        elif isinstance(message, AssistantMessage):
            reasoning = message.reasoning_content or message.reasoning
            if reasoning:
                messages.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            if message.text():  # beside tool calls, the text was a preamble: the commentary channel
                channel = "commentary" if message.tool_calls else "final"
                messages.append(Message.from_role_and_content(Role.ASSISTANT, message.text()).with_channel(channel))
            for call in message.tool_calls or []:
                call_names[call.id] = pending[call.id] = call.function.name
                answers[call.id] = None
                messages.append(assistant_call(f"functions.{call.function.name}", call.function.arguments))
            pending_at = i
        elif isinstance(message, ToolMessage):
            name = pending.pop(message.tool_call_id, None)
            if name is None:
                if message.tool_call_id in call_names:  # answered already, or not by the messages right after it
                    raise APIError(
                        "Messages with role 'tool' must be a response to a preceding message with "
                        f"'tool_calls': tool call '{message.tool_call_id}' has been answered.",
                        param=f"messages[{i}].tool_call_id",
                    )
                raise APIError(
                    f"No assistant tool call has id '{message.tool_call_id}'.", param=f"messages[{i}].tool_call_id"
                )
            answers[message.tool_call_id] = tool_message(f"functions.{name}", message.text())
            if not pending:  # Harmony has no call ids: the results follow in the order of their calls
                messages += answers.values()
                answers = {}
    if pending:
        _unanswered(pending, pending_at)

    for i, tool in enumerate(req.tools or []):
        if isinstance(tool, ChatCustomTool):
            raise APIError(
                "Unsupported value for 'tools': custom tools are not supported by this server's Chat "
                "Completions; use /v1/responses, which takes them, or a function tool.",
                param=f"tools[{i}]",
                code="unsupported_value",
            )
    for i, message in enumerate(req.messages):
        if isinstance(message, AssistantMessage) and any(c.type == "custom" for c in message.tool_calls or []):
            raise APIError(
                "Unsupported value: custom tool calls are not supported by this server's Chat "
                "Completions; use /v1/responses.",
                param=f"messages[{i}].tool_calls",
                code="unsupported_value",
            )
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("Function names in 'tools' must be unique.", param="tools")
    tools, choice = _tools_and_choice(req)  # (the turn grammar forces the call: `chat_turn_rules`)
    if isinstance(choice, NamedToolChoice):
        if not any(t.function.name == choice.function.name for t in tools):
            raise APIError(
                f"Tool choice '{choice.function.name}' is not one of the functions in 'tools'.", param="tool_choice"
            )
    elif choice == "required":
        if not tools:
            raise APIError("Tool choice 'required' must be specified with 'tools' parameter.", param="tool_choice")
    functions = (
        []
        if choice == "none"
        else [
            ToolDescription.new(t.function.name, t.function.description or "", parameters=t.function.parameters)
            for t in tools
        ]
    )
    config = PromptConfig(
        reasoning_effort=req.effort,
        instructions="\n\n".join(t for t in [*instructions, verbosity_note(req.verbosity)] if t) or None,
        function_tools=functions,
        response_format=_response_format(req),
        conversation_start_date=datetime.date.today().isoformat(),
    )
    return preamble(config) + messages


def chat_turn_rules(req: ChatCompletionRequest, structure: bool) -> TurnRules | None:
    """What the turn grammar holds each choice to (`agent_server/turn_grammar.py`): Harmony's
    structure where `structure` is on, and in any case what the request asks to be enforced: a
    strict schema or `json_object` for the content, strict function arguments, a forced call.
    None: nothing (also with `ignore_eos`, which generates past the end of the turn)."""
    if req.ignore_eos:
        return None
    tools, choice = _tools_and_choice(req)
    tools = [] if choice == "none" else tools
    strict = False
    for tool in tools:
        f = tool.function
        if f.strict and f.parameters is not None:
            i = next(k for k, t in enumerate(req.tools or []) if t is tool)
            strict = True
            error = check_strict_schema(f.parameters)
            if error:
                raise APIError(
                    f"Invalid schema for function '{f.name}': {error}",
                    param=f"tools[{i}].function.parameters",
                    code="invalid_function_parameters",
                )
    answer = None
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        answer = {"type": "object"}
    elif isinstance(fmt, ResponseFormatJsonSchema) and fmt.json_schema.strict and fmt.json_schema.schema_ is not None:
        answer = fmt.json_schema.schema_
        error = check_strict_schema(answer)
        if error:
            raise APIError(
                f"Invalid schema for response_format '{fmt.json_schema.name}': {error}",
                param="response_format.json_schema.schema",
                code="invalid_json_schema",
            )
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    forced = [
        CallTarget(
            f"functions.{t.function.name}",
            "commentary",
            function_arguments(t.function.parameters, strict=t.function.strict, forced=True),
        )
        for t in tools
        if choice == "required" or t.function.name == named
    ]
    if not (structure or forced or answer is not None or strict):
        return None
    calls = [
        CallTarget(
            f"functions.{t.function.name}",
            "commentary",
            function_arguments(t.function.parameters, strict=t.function.strict, forced=False),
        )
        for t in tools
    ]
    return TurnRules(calls, forced, answer, parallel_calls=req.parallel_tool_calls is not False)


def _tools_and_choice(req: ChatCompletionRequest) -> tuple[list[ChatTool], object]:
    """The tools the model may call and the tool choice: an `allowed_tools` choice narrows the
    tools and becomes "required" or "auto" (a custom choice is refused)."""
    tools, choice = req.tools or [], req.tool_choice
    if isinstance(choice, AllowedToolsChoice):
        tools, required = _allowed(tools, choice), choice.allowed_tools.mode == "required"
        choice = "required" if required else "auto"
    if isinstance(choice, NamedCustomChoice):
        raise APIError(
            "Unsupported value for 'tool_choice': custom tools are not supported by this server's Chat Completions.",
            param="tool_choice",
            code="unsupported_value",
        )
    return tools, choice


def _allowed(tools: list[ChatTool], choice: AllowedToolsChoice) -> list[ChatTool]:
    """The tools an `allowed_tools` choice keeps; each entry names one of `tools`."""
    names = set()
    for i, entry in enumerate(choice.allowed_tools.tools):
        name = (entry.get("function") or {}).get("name") if isinstance(entry.get("function"), dict) else None
        if entry.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                'Invalid value: each allowed tool is {"type": "function", "function": {"name": ...}}.',
                param=f"tool_choice.allowed_tools.tools[{i}]",
                code="invalid_value",
            )
        if not any(t.function.name == name for t in tools):
            raise APIError(
                f"Allowed tool '{name}' is not one of the functions in 'tools'.",
                param=f"tool_choice.allowed_tools.tools[{i}]",
            )
        names.add(name)
    return [t for t in tools if t.function.name in names]


def _unanswered(pending: dict[str, str], index: int) -> None:
    """OpenAI's error for tool calls that the tool messages right after them do not all answer."""
    raise APIError(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: "
        f"{', '.join(pending)}",
        param=f"messages[{index}]",
    )


def _response_format(req: ChatCompletionRequest) -> dict | None:
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonSchema):
        spec = fmt.json_schema
        return {"name": spec.name, "schema": spec.schema_, "description": spec.description}
    if isinstance(fmt, ResponseFormatJsonObject):
        return {
            "name": "json_object",
            "schema": {"type": "object"},
            "description": "Answer with a single JSON object and nothing else.",
        }
    return None
