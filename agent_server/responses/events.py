"""The Responses API's stream: SDK event objects, numbered, in the order OpenAI emits them.

`ResponseEvents` owns one `Response` snapshot and publishes every event through a callback
(the run's event log). The agent loop drives it through one writer per output item; each writer
emits exactly its item's events, e.g. for a message

    output_item.added -> content_part.added -> output_text.delta* (annotation.added*)
    -> output_text.done -> content_part.done -> output_item.done

so the loop never has to think about sequence numbers, output indexes or part indexes.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable

from openai.types.responses import (
    Response,
    ResponseCodeInterpreterCallCodeDeltaEvent,
    ResponseCodeInterpreterCallCodeDoneEvent,
    ResponseCodeInterpreterCallCompletedEvent,
    ResponseCodeInterpreterCallInProgressEvent,
    ResponseCodeInterpreterCallInterpretingEvent,
    ResponseCodeInterpreterToolCall,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseCustomToolCall,
    ResponseCustomToolCallInputDeltaEvent,
    ResponseCustomToolCallInputDoneEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseFunctionWebSearch,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseMcpCallArgumentsDeltaEvent,
    ResponseMcpCallArgumentsDoneEvent,
    ResponseMcpCallCompletedEvent,
    ResponseMcpCallFailedEvent,
    ResponseMcpCallInProgressEvent,
    ResponseMcpListToolsCompletedEvent,
    ResponseMcpListToolsInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseOutputTextAnnotationAddedEvent,
    ResponseQueuedEvent,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseWebSearchCallCompletedEvent,
    ResponseWebSearchCallInProgressEvent,
    ResponseWebSearchCallSearchingEvent,
)
from openai.types.responses.response_code_interpreter_tool_call import OutputLogs
from openai.types.responses.response_output_item import LocalShellCall, McpCall, McpListTools, McpListToolsTool
from openai.types.responses.response_output_text import AnnotationURLCitation
from openai.types.responses.response_reasoning_item import Content as ReasoningContent

LIFECYCLE = {
    "response.created": ResponseCreatedEvent,
    "response.queued": ResponseQueuedEvent,
    "response.in_progress": ResponseInProgressEvent,
    "response.completed": ResponseCompletedEvent,
    "response.incomplete": ResponseIncompleteEvent,
    "response.failed": ResponseFailedEvent,
}
# The stream has no "response.cancelled" event: a cancelled response ends with response.failed
# carrying status "cancelled" (and no error).
TERMINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.failed",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def dump(model: Any) -> dict[str, Any]:
    """JSON-ready dict of an SDK object, leaving out optional fields never set; a response's
    times (its own, or an event's response's) in whole seconds."""
    data = model.model_dump(mode="json", exclude_unset=True, by_alias=True)
    whole_seconds(data.get("response") if isinstance(data.get("response"), dict) else data)
    return data


def whole_seconds(response: dict[str, Any]) -> None:
    """`created_at` / `completed_at` as integers, as OpenAI sends them: the SDK types them as
    floats, so they come out of it as 1700000000.0."""
    for key in ("created_at", "completed_at"):
        value = response.get(key)
        if isinstance(value, float) and value.is_integer():
            response[key] = int(value)


class ResponseEvents:
    """One response's snapshot and its numbered event stream."""

    def __init__(self, response: Response, publish: Callable[[Any], None]):
        self.response = response
        self.publish = publish
        self.sequence_number = 0

    def emit(self, event_class: type, **fields: Any) -> Any:
        event = event_class(
            type=event_class.model_fields["type"].annotation.__args__[0], sequence_number=self.sequence_number, **fields
        )
        self.sequence_number += 1
        self.publish(event)
        return event

    def lifecycle(self, event_type: str) -> None:
        """response.created / queued / in_progress / completed / incomplete / failed, with a
        copy of the snapshot as it is now."""
        self.emit(LIFECYCLE[event_type], response=self.response.model_copy(deep=True))

    def finish(self, status: str) -> None:
        self.response.status = status
        if status == "completed":
            self.response.completed_at = int(time.time())
        self.lifecycle(TERMINAL_EVENT[status])

    def add_item(self, item: Any) -> int:
        self.response.output.append(item)
        index = len(self.response.output) - 1
        self.emit(ResponseOutputItemAddedEvent, output_index=index, item=item.model_copy(deep=True))
        return index

    def item_done(self, index: int) -> None:
        item = self.response.output[index].model_copy(deep=True)
        self.emit(ResponseOutputItemDoneEvent, output_index=index, item=item)


class ReasoningWriter:
    """A `reasoning` item carrying the analysis channel as `reasoning_text` content."""

    def __init__(self, events: ResponseEvents, seal: Callable[[str], str] | None = None):
        self.events = events
        self.seal = seal
        self.item = ResponseReasoningItem(
            id=new_id("rs"), type="reasoning", summary=[], content=[], status="in_progress"
        )
        self.index = events.add_item(self.item)
        self.text = ""
        events.emit(
            ResponseContentPartAddedEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            part={"type": "reasoning_text", "text": ""},
        )
        self.item.content = [ReasoningContent(type="reasoning_text", text="")]

    def delta(self, text: str) -> None:
        self.text += text
        self.item.content[0].text = self.text
        self.events.emit(
            ResponseReasoningTextDeltaEvent, item_id=self.item.id, output_index=self.index, content_index=0, delta=text
        )

    def done(self, status: str = "completed") -> None:
        ev = self.events
        ev.emit(
            ResponseReasoningTextDoneEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            text=self.text,
        )
        ev.emit(
            ResponseContentPartDoneEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            part={"type": "reasoning_text", "text": self.text},
        )
        self.item.status = status
        if self.seal is not None:
            self.item.encrypted_content = self.seal(self.text)
        ev.item_done(self.index)


class MessageWriter:
    """An assistant `message` with one `output_text` part (final answer or preamble)."""

    def __init__(self, events: ResponseEvents, phase: str | None = None):
        self.events = events
        self.item = ResponseOutputMessage(
            id=new_id("msg"), type="message", role="assistant", status="in_progress", content=[]
        )
        if phase:
            self.item.phase = phase
        self.index = events.add_item(self.item)
        self.part = ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
        events.emit(
            ResponseContentPartAddedEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            part=self.part.model_copy(deep=True),
        )
        self.item.content = [self.part]

    @property
    def text(self) -> str:
        return self.part.text

    def delta(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        """`logprobs`: entries (`logprob_entry`) of the tokens this text completes, when asked for."""
        if not text:
            return
        self.part.text += text
        if logprobs:
            self.part.logprobs += ResponseOutputText.model_validate(
                {"type": "output_text", "text": "", "annotations": [], "logprobs": logprobs}
            ).logprobs
        self.events.emit(
            ResponseTextDeltaEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            delta=text,
            logprobs=logprobs or [],  # with their `bytes`: dialect.py writes them per dialect
        )

    def annotate(self, url: str, title: str, start_index: int, end_index: int) -> None:
        annotation = AnnotationURLCitation(
            type="url_citation", url=url, title=title, start_index=start_index, end_index=end_index
        )
        self.part.annotations.append(annotation)
        self.events.emit(
            ResponseOutputTextAnnotationAddedEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            annotation_index=len(self.part.annotations) - 1,
            annotation=dump(annotation),
        )

    def done(self, status: str = "completed") -> None:
        ev = self.events
        ev.emit(
            ResponseTextDoneEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            text=self.part.text,
            logprobs=[dump(lp) for lp in self.part.logprobs],
        )
        ev.emit(
            ResponseContentPartDoneEvent,
            item_id=self.item.id,
            output_index=self.index,
            content_index=0,
            part=self.part.model_copy(deep=True),
        )
        self.item.status = status
        ev.item_done(self.index)


class FunctionCallWriter:
    """A `function_call` for the client to run; arguments stream as they are generated."""

    def __init__(self, events: ResponseEvents, name: str, namespace: str | None = None):
        self.events = events
        self.item = ResponseFunctionToolCall(
            id=new_id("fc"), call_id=new_id("call"), type="function_call", name=name, arguments="", status="in_progress"
        )
        if namespace:
            self.item.namespace = namespace
        self.index = events.add_item(self.item)

    def delta(self, text: str) -> None:
        if not text:
            return
        self.item.arguments += text
        self.events.emit(
            ResponseFunctionCallArgumentsDeltaEvent, item_id=self.item.id, output_index=self.index, delta=text
        )

    def done(self, status: str = "completed") -> None:
        self.events.emit(
            ResponseFunctionCallArgumentsDoneEvent,
            item_id=self.item.id,
            output_index=self.index,
            arguments=self.item.arguments,
        )
        self.item.status = status
        self.events.item_done(self.index)


class CustomToolCallWriter:
    """A `custom_tool_call` for the client to run: freeform text input, streamed as generated
    and made plain at the end (`custom_input`: the model may have quoted it as a JSON string)."""

    def __init__(
        self,
        events: ResponseEvents,
        name: str,
        namespace: str | None = None,
        final_input: Callable[[str], str] = lambda text: text,
    ):
        self.events = events
        self.final_input = final_input
        self.item = ResponseCustomToolCall(
            id=new_id("ctc"), call_id=new_id("call"), type="custom_tool_call", name=name, input=""
        )
        if namespace:
            self.item.namespace = namespace
        self.raw = ""
        self.index = events.add_item(self.item)

    def delta(self, text: str) -> None:
        if not text:
            return
        self.raw += text
        self.item.input = self.raw
        self.events.emit(
            ResponseCustomToolCallInputDeltaEvent, item_id=self.item.id, output_index=self.index, delta=text
        )

    def done(self, status: str = "completed") -> None:
        self.item.input = self.final_input(self.raw)
        self.events.emit(
            ResponseCustomToolCallInputDoneEvent, item_id=self.item.id, output_index=self.index, input=self.item.input
        )
        self.events.item_done(self.index)


class LocalShellCallWriter:
    """A `local_shell_call` for the client to run; its action is read from the model's arguments
    once they are complete (`action_of`)."""

    def __init__(self, events: ResponseEvents, action_of: Callable[[str], dict[str, Any]]):
        self.events = events
        self.action_of = action_of
        self.arguments = ""
        self.item = LocalShellCall(
            id=new_id("lsh"),
            call_id=new_id("call"),
            type="local_shell_call",
            status="in_progress",
            action={"type": "exec", "command": [], "env": {}},
        )
        self.index = events.add_item(self.item)

    def delta(self, text: str) -> None:
        self.arguments += text

    def done(self, status: str = "completed") -> None:
        self.item.action = LocalShellCall.model_validate(
            {**dump(self.item), "action": self.action_of(self.arguments)}
        ).action
        self.item.status = status
        self.events.item_done(self.index)


class WebSearchWriter:
    """A `web_search_call`: the browser's search / open / find, run by the server."""

    def __init__(self, events: ResponseEvents):
        self.events = events
        self.item = ResponseFunctionWebSearch(
            id=new_id("ws"), type="web_search_call", status="in_progress", action={"type": "search"}
        )
        self.index = events.add_item(self.item)
        events.emit(ResponseWebSearchCallInProgressEvent, item_id=self.item.id, output_index=self.index)

    def delta(self, text: str) -> None:  # the call's arguments are not part of this item
        pass

    def searching(self, action: dict[str, Any]) -> None:
        self.item.action = ResponseFunctionWebSearch.model_validate(
            {"id": self.item.id, "type": "web_search_call", "status": "searching", "action": action}
        ).action
        self.item.status = "searching"
        self.events.emit(ResponseWebSearchCallSearchingEvent, item_id=self.item.id, output_index=self.index)

    def done(self, status: str = "completed") -> None:
        if status == "completed":
            self.events.emit(ResponseWebSearchCallCompletedEvent, item_id=self.item.id, output_index=self.index)
        self.item.status = status
        self.events.item_done(self.index)


class CodeInterpreterWriter:
    """A `code_interpreter_call`: the code streams as the model writes it, then runs."""

    def __init__(self, events: ResponseEvents, container_id: str):
        self.events = events
        self.item = ResponseCodeInterpreterToolCall(
            id=new_id("ci"),
            type="code_interpreter_call",
            code="",
            container_id=container_id,
            outputs=None,
            status="in_progress",
        )
        self.index = events.add_item(self.item)
        events.emit(ResponseCodeInterpreterCallInProgressEvent, item_id=self.item.id, output_index=self.index)

    def delta(self, text: str) -> None:
        if not text:
            return
        self.item.code += text
        self.events.emit(
            ResponseCodeInterpreterCallCodeDeltaEvent, item_id=self.item.id, output_index=self.index, delta=text
        )

    def interpreting(self) -> None:
        self.events.emit(
            ResponseCodeInterpreterCallCodeDoneEvent, item_id=self.item.id, output_index=self.index, code=self.item.code
        )
        self.item.status = "interpreting"
        self.events.emit(ResponseCodeInterpreterCallInterpretingEvent, item_id=self.item.id, output_index=self.index)

    def done(self, status: str = "completed", logs: str | None = None) -> None:
        if logs is not None:
            self.item.outputs = [OutputLogs(type="logs", logs=logs)]
        if status == "completed":
            self.events.emit(ResponseCodeInterpreterCallCompletedEvent, item_id=self.item.id, output_index=self.index)
        self.item.status = status
        self.events.item_done(self.index)


class McpListToolsWriter:
    """An `mcp_list_tools` item: what an MCP server offers, shown once per conversation."""

    def __init__(self, events: ResponseEvents, server_label: str, tools: list[dict[str, Any]]):
        item = McpListTools(id=new_id("mcpl"), type="mcp_list_tools", server_label=server_label, tools=[])
        index = events.add_item(item)
        events.emit(ResponseMcpListToolsInProgressEvent, item_id=item.id, output_index=index)
        item.tools = [McpListToolsTool(**tool) for tool in tools]
        events.emit(ResponseMcpListToolsCompletedEvent, item_id=item.id, output_index=index)
        events.item_done(index)
        self.item = item


class McpCallWriter:
    """An `mcp_call` to a tool of an MCP server, run by the server."""

    def __init__(self, events: ResponseEvents, server_label: str, name: str):
        self.events = events
        self.item = McpCall(
            id=new_id("mcp"), type="mcp_call", server_label=server_label, name=name, arguments="", status="in_progress"
        )
        self.index = events.add_item(self.item)

    def delta(self, text: str) -> None:
        if not text:
            return
        self.item.arguments += text
        self.events.emit(ResponseMcpCallArgumentsDeltaEvent, item_id=self.item.id, output_index=self.index, delta=text)

    def calling(self) -> None:
        self.events.emit(
            ResponseMcpCallArgumentsDoneEvent,
            item_id=self.item.id,
            output_index=self.index,
            arguments=self.item.arguments,
        )
        self.item.status = "calling"
        self.events.emit(ResponseMcpCallInProgressEvent, item_id=self.item.id, output_index=self.index)

    def done(self, status: str = "completed", output: str | None = None, error: str | None = None) -> None:
        if error is not None:
            self.item.error = McpCall.model_validate(
                {**dump(self.item), "error": {"type": "mcp_tool_execution_error", "content": error}}
            ).error
            self.events.emit(ResponseMcpCallFailedEvent, item_id=self.item.id, output_index=self.index)
            status = "failed"
        elif status == "completed":
            self.item.output = output
            self.events.emit(ResponseMcpCallCompletedEvent, item_id=self.item.id, output_index=self.index)
        self.item.status = status
        self.events.item_done(self.index)


def warm_up() -> None:
    """Build every item and event once, discarding them: the SDK's pydantic models compile
    their validators on first use (a fraction of a second each), which the first request of a
    fresh server would otherwise pay in its time to first token."""
    response = Response.model_validate(
        {
            "id": "resp_warmup",
            "created_at": 0,
            "model": "m",
            "object": "response",
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    )
    events = ResponseEvents(response, lambda event: None)
    events.lifecycle("response.created")
    for writer in (
        ReasoningWriter(events),
        MessageWriter(events, phase="final_answer"),
        FunctionCallWriter(events, "f"),
        CodeInterpreterWriter(events, "cntr_warmup"),
        McpCallWriter(events, "label", "tool"),
        CustomToolCallWriter(events, "c", "ns"),
        LocalShellCallWriter(events, lambda arguments: {"type": "exec", "command": ["x"], "env": {}}),
    ):
        writer.delta("x")
        if isinstance(writer, MessageWriter):
            writer.annotate("https://example.org", "t", 0, 1)
        if isinstance(writer, CodeInterpreterWriter):
            writer.interpreting()
            writer.done(logs="x")
        elif isinstance(writer, McpCallWriter):
            writer.calling()
            writer.done(output="x")
        else:
            writer.done()
    search = WebSearchWriter(events)
    search.searching({"type": "search", "query": "x"})
    search.done()
    McpListToolsWriter(events, "label", [{"name": "t", "input_schema": {}}])
    events.finish("completed")
