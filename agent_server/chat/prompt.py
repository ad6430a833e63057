"""Chat Completions messages -> a Harmony prompt.

system/developer -> developer instructions; user -> user; assistant -> its earlier reasoning
(`reasoning_content`) on the analysis channel, its text on the final channel and each tool call
as a commentary message to `functions.<name>`; tool -> a tool message from that function.
"""

from __future__ import annotations

import datetime

from openai_harmony import Message, Role, ToolDescription

from schemas.chat import (
    AssistantMessage,
    ChatCompletionRequest,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SystemMessage,
    ToolMessage,
    UserMessage,
)

from agent_server.responses.conversation import assistant_call
from agent_server.errors import APIError
from agent_server.harmony import PromptConfig, preamble, render_prompt, tool_message
from agent_server.turn_grammar import CallTarget, TurnRules, check_strict_schema, function_arguments


def chat_prompt(req: ChatCompletionRequest) -> list[int]:
    """The request's conversation rendered for the assistant's next turn."""
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
                    raise APIError("Messages with role 'tool' must be a response to a preceding message with "
                                   f"'tool_calls': tool call '{message.tool_call_id}' has been answered.",
                                   param=f"messages[{i}].tool_call_id")
                raise APIError(f"No assistant tool call has id '{message.tool_call_id}'.",
                               param=f"messages[{i}].tool_call_id")
            answers[message.tool_call_id] = tool_message(f"functions.{name}", message.text())
            if not pending:  # Harmony has no call ids: the results follow in the order of their calls
                messages += answers.values()
                answers = {}
    if pending:
        _unanswered(pending, pending_at)

    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("Function names in 'tools' must be unique.", param="tools")
    choice = req.tool_choice  # (the turn grammar forces the call: `chat_turn_rules`)
    if isinstance(choice, NamedToolChoice):
        if not any(t.function.name == choice.function.name for t in tools):
            raise APIError(f"Tool choice '{choice.function.name}' is not one of the functions in 'tools'.",
                           param="tool_choice")
    elif choice == "required":
        if not tools:
            raise APIError("Tool choice 'required' must be specified with 'tools' parameter.", param="tool_choice")
    functions = [] if choice == "none" else [
        ToolDescription.new(t.function.name, t.function.description or "", parameters=t.function.parameters)
        for t in tools
    ]
    config = PromptConfig(
        reasoning_effort=req.reasoning_effort or "medium",
        instructions="\n\n".join(t for t in instructions if t) or None,
        function_tools=functions,
        response_format=_response_format(req),
        conversation_start_date=datetime.date.today().isoformat(),
    )
    return render_prompt(preamble(config) + messages)


def chat_turn_rules(req: ChatCompletionRequest, structure: bool) -> TurnRules | None:
    """What the turn grammar holds each choice to (`agent_server/turn_grammar.py`): Harmony's
    structure where `structure` is on, and in any case what the request asks to be enforced: a
    strict schema or `json_object` for the content, strict function arguments, a forced call.
    None: nothing (also with `ignore_eos`, which generates past the end of the turn)."""
    if req.ignore_eos:
        return None
    tools = [] if req.tool_choice == "none" else req.tools or []
    strict = False
    for i, tool in enumerate(tools):
        f = tool.function
        if f.strict and f.parameters is not None:
            strict = True
            error = check_strict_schema(f.parameters)
            if error:
                raise APIError(f"Invalid schema for function '{f.name}': {error}", param=f"tools[{i}].function.parameters",
                               code="invalid_function_parameters")
    answer = None
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        answer = {"type": "object"}
    elif isinstance(fmt, ResponseFormatJsonSchema) and fmt.json_schema.strict and fmt.json_schema.schema_ is not None:
        answer = fmt.json_schema.schema_
        error = check_strict_schema(answer)
        if error:
            raise APIError(f"Invalid schema for response_format '{fmt.json_schema.name}': {error}",
                           param="response_format.json_schema.schema", code="invalid_json_schema")
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    forced = [CallTarget(f"functions.{t.function.name}", "commentary",
                         function_arguments(t.function.parameters, strict=t.function.strict, forced=True))
              for t in tools if choice == "required" or t.function.name == named]
    if not (structure or forced or answer is not None or strict):
        return None
    calls = [CallTarget(f"functions.{t.function.name}", "commentary",
                        function_arguments(t.function.parameters, strict=t.function.strict, forced=False))
             for t in tools]
    return TurnRules(calls, forced, answer, parallel_calls=req.parallel_tool_calls is not False)


def _unanswered(pending: dict[str, str], index: int) -> None:
    """OpenAI's error for tool calls that the tool messages right after them do not all answer."""
    raise APIError("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                   f"'tool_call_id'. The following tool_call_ids did not have response messages: "
                   f"{', '.join(pending)}", param=f"messages[{index}]")


def _response_format(req: ChatCompletionRequest) -> dict | None:
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonSchema):
        spec = fmt.json_schema
        return {"name": spec.name, "schema": spec.schema_, "description": spec.description}
    if isinstance(fmt, ResponseFormatJsonObject):
        return {"name": "json_object", "schema": {"type": "object"},
                "description": "Answer with a single JSON object and nothing else."}
    return None
