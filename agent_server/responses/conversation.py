"""Responses API input items -> Harmony messages.

user text -> user message; assistant text -> final-channel message (commentary for preambles);
`reasoning` -> analysis message (its sealed `encrypted_content` opened, when it has one);
`compaction` -> the summary it carries, as an assistant message (`responses/compaction.py`);
`function_call` -> commentary message to `functions.<name>` (or `<namespace>.<name>`,
JSON-constrained); `custom_tool_call` the same with its freeform input; `local_shell_call` a
call of `functions.local_shell`; their outputs -> a tool message from that recipient, found
through the call id; our own `code_interpreter_call` / `mcp_call` items sent back as input
replay the call and its output. System and developer messages in `input` join the
instructions (Harmony has one developer message, at the top). Items that change settings
rather than the conversation (`additional_tools`, `tool_search_*`, `configuration_update`) are
read by the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from openai_harmony import Message, Role

from agent_server.client_tools import LOCAL_SHELL, local_shell_arguments, recipient_of
from agent_server.errors import APIError
from agent_server.harmony import tool_message
from agent_server.responses.compaction import summary_message
from schemas.responses import (
    CodeInterpreterCallItem,
    CompactionItem,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    LenientItem,
    LocalShellCallItem,
    LocalShellCallOutputItem,
    McpCallItem,
    MessageItem,
    ReasoningItem,
)

OUTPUTS = (FunctionCallOutputItem, CustomToolCallOutputItem, LocalShellCallOutputItem)

JSON_CONTENT_TYPE = "<|constrain|>json"


@dataclass
class ConvertedInput:
    messages: list[Message] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)  # from system/developer input messages
    # call_id -> qualified name ("name", "namespace.name"), seen in this input
    function_calls: dict[str, str] = field(default_factory=dict)


def assistant_call(recipient: str, arguments: str, channel: str = "commentary", json_args: bool = True) -> Message:
    message = Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel(channel).with_recipient(recipient)
    return message.with_content_type(JSON_CONTENT_TYPE) if json_args else message


def input_to_messages(
    items: list[Any],
    known_calls: dict[str, str],
    open_reasoning: Callable[[str], str] | None = None,
    open_summary: Callable[[str], str] | None = None,
) -> ConvertedInput:
    """Convert validated input items. `known_calls` maps call ids of earlier responses in the
    chain to function names; `open_reasoning` opens a reasoning item's `encrypted_content`
    (`ReasoningSeal.open`), `open_summary` a compaction item's (`ReasoningSeal.open_summary`).
    APIError names the offending item."""
    out = ConvertedInput()
    unanswered: dict[str, tuple[Any, Message]] = {}  # client tool calls of this input, no output yet
    shell_calls: dict[str, str] = {}  # local_shell_call item id -> its call id (an output names either)
    outputs_run: list[tuple[int, Message]] = []  # consecutive function_call_outputs, by their call's place
    call_order = {call_id: n for n, call_id in enumerate(known_calls)}  # and this input's calls after them
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            text = item.text()
            if item.role in ("system", "developer"):
                out.instructions.append(text)
            elif item.role == "user":
                out.messages.append(Message.from_role_and_content(Role.USER, text))
            else:
                channel = "commentary" if item.phase == "commentary" else "final"
                out.messages.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel))
        elif isinstance(item, ReasoningItem):
            if item.encrypted_content:  # what the model wrote, authenticated: it wins over `content`
                text = _opened(item.encrypted_content, open_reasoning, i, "reasoning")
            else:
                text = "".join(p.text for p in item.content or []) or "".join(s.text for s in item.summary)
            if text:
                out.messages.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("analysis"))
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem, LocalShellCallItem)):
            if isinstance(item, LocalShellCallItem):
                name, message = (
                    LOCAL_SHELL,
                    assistant_call(recipient_of(LOCAL_SHELL), local_shell_arguments(item.action)),
                )
                shell_calls[item.id] = item.call_id
            else:
                name = f"{item.namespace}.{item.name}" if item.namespace else item.name
                if isinstance(item, CustomToolCallItem):
                    message = assistant_call(recipient_of(name), item.input, json_args=False)
                else:
                    message = assistant_call(recipient_of(name), item.arguments)
            out.function_calls[item.call_id] = name
            call_order.setdefault(item.call_id, len(call_order))
            out.messages.append(message)
            unanswered[item.call_id] = (item, out.messages[-1])
        elif isinstance(item, OUTPUTS):
            call_id = shell_calls.get(item.id, item.id) if isinstance(item, LocalShellCallOutputItem) else item.call_id
            name = out.function_calls.get(call_id) or known_calls.get(call_id)
            if name is None:
                raise APIError(
                    f"No tool call found for {item.type} with call_id {call_id}.",
                    param=f"input[{i}].{'id' if isinstance(item, LocalShellCallOutputItem) else 'call_id'}",
                )
            text = item.output if isinstance(item, LocalShellCallOutputItem) else item.text()
            out.messages.append(tool_message(recipient_of(name), text))
            unanswered.pop(call_id, None)
            outputs_run.append((call_order[call_id], out.messages[-1]))
            if not isinstance(items[i + 1] if i + 1 < len(items) else None, OUTPUTS):
                _in_call_order(out.messages, outputs_run)
                outputs_run = []
        elif isinstance(item, CompactionItem):
            out.messages.append(summary_message(_opened(item.encrypted_content, open_summary, i, "compaction")))
        elif isinstance(item, LenientItem):
            out.messages += _replayed_call(item)
    for call_id, (item, message) in unanswered.items():
        # A call cut short (the token limit): nobody could run it.
        if getattr(item, "status", None) in ("incomplete", "in_progress"):
            out.messages = [m for m in out.messages if m is not message]
        else:  # the model would read a call with no result after it
            raise APIError(f"No tool output found for function call {call_id}.", param="input")
    return out


def _opened(blob: str, opener: Callable[[str], str] | None, index: int, kind: str) -> str:
    from agent_server.reasoning_seal import SealError

    param = f"input[{index}].encrypted_content"
    if opener is None:
        what = "Encrypted reasoning" if kind == "reasoning" else "A compaction item"
        raise APIError(f"{what} cannot be read by this server.", param=param, code="invalid_encrypted_content")
    try:
        return opener(blob)
    except SealError as e:
        items = "reasoning items" if kind == "reasoning" else "compaction items"
        raise APIError(
            f"Invalid 'encrypted_content': {e}. Send {items} back as this server returned them.",
            param=param,
            code="invalid_encrypted_content",
        ) from None


def _in_call_order(messages: list[Message], run: list[tuple[int, Message]]) -> None:
    """Put a run of function outputs (the last len(run) messages) in the order of their calls:
    Harmony has no call ids, so the model pairs results with calls by their order."""
    if len(run) > 1:
        messages[-len(run) :] = [message for _, message in sorted(run, key=lambda entry: entry[0])]


def _replayed_call(item: LenientItem) -> list[Message]:
    """Our own built-in tool items, sent back by a client that manages its context."""
    if isinstance(item, CodeInterpreterCallItem) and item.code:
        messages = [assistant_call("python", item.code, channel="analysis", json_args=False)]
        logs = "".join(o.logs or "" for o in item.outputs or [])
        return messages + [tool_message("python", logs)]
    if isinstance(item, McpCallItem) and item.name:
        recipient = f"{item.server_label or ''}.{item.name}"
        messages = [assistant_call(recipient, item.arguments or "{}")]
        return messages + [tool_message(recipient, item.output or json.dumps(item.error or ""))]
    # A web_search_call item carries no results: the search itself cannot be replayed.
    return []


def messages_from_json(raw: list[dict[str, Any]]) -> list[Message]:
    return [Message.from_dict(m) for m in raw]


def messages_to_json(messages: list[Message]) -> list[dict[str, Any]]:
    return [m.to_dict() for m in messages]
