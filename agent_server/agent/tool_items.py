"""One output item per tool kind: what the Responses stream shows of a call, from the model
addressing the tool to the tool's answer.

The agent loop treats every call alike: it opens the kind's item when a Harmony message names
the tool (`open_tool_item`), streams the arguments into it, and, for the calls the server runs
itself, marks it running and then finished with the tool's answer. What differs by kind (the
event types, the web search action, code interpreter logs, MCP output) lives in the kind's class.

    to=functions.*      -> function_call, custom_tool_call or local_shell_call (the client runs it)
    to=browser.*        -> web_search_call        (the server runs it)
    to=python           -> code_interpreter_call  (the server runs it)
    to=<mcp namespace>  -> mcp_call               (the server runs it)
"""

from __future__ import annotations

from typing import Any

from agent_server.agent.tool_registry import Route
from agent_server.client_tools import custom_input, local_shell_action
from agent_server.responses.events import (
    CodeInterpreterWriter,
    CustomToolCallWriter,
    FunctionCallWriter,
    LocalShellCallWriter,
    McpCallWriter,
    ResponseEvents,
    WebSearchWriter,
)


class ToolCallItem:
    """A call's output item. `runs_here`: the server runs the tool (built-in or MCP); otherwise
    the client does (a function call), and the response ends for it to answer."""

    runs_here = True

    def __init__(self, writer: Any, route: Route):
        self.writer = writer
        self.route = route

    @property
    def item(self) -> Any:
        return self.writer.item

    @property
    def metric_label(self) -> str:
        return self.route.kind

    def delta(self, text: str) -> None:
        self.writer.delta(text)

    def done(self, status: str = "completed") -> None:
        self.writer.done(status)

    def running(self, args: dict) -> None:
        """The call is about to run (its arguments, parsed: {} where they are not a JSON object)."""

    def finished(self, ok: bool, text: str, args: dict, details: dict, include: set[str]) -> None:
        """The tool answered `text` (an error message where not ok); `details`: what the tool
        reported beside the text (the page's URL, the search's sources)."""
        self.done("completed" if ok else "failed")


class ClientToolCall(ToolCallItem):
    """A call of one of the client's own tools (`agent_server/client_tools.py`): a function, a
    custom tool (freeform input) or the local shell."""

    runs_here = False

    @classmethod
    def open(cls, events: ResponseEvents, route: Route, container_id: str) -> ClientToolCall:
        tool = route.client
        if tool.kind == "custom":
            writer = CustomToolCallWriter(events, tool.name, tool.namespace, final_input=custom_input)
        elif tool.kind == "local_shell":
            writer = LocalShellCallWriter(events, local_shell_action)
        else:
            writer = FunctionCallWriter(events, tool.name, tool.namespace)
        return cls(writer, route)


class WebSearchCall(ToolCallItem):
    @classmethod
    def open(cls, events: ResponseEvents, route: Route, container_id: str) -> WebSearchCall:
        return cls(WebSearchWriter(events), route)

    def running(self, args: dict) -> None:
        self.writer.searching(web_action(self.route.name, args, {}, include_sources=False))

    def finished(self, ok: bool, text: str, args: dict, details: dict, include: set[str]) -> None:
        include_sources = "web_search_call.action.sources" in include
        item = self.writer.item
        item.action = (
            type(item)
            .model_validate(
                {
                    **item.model_dump(exclude_unset=True),
                    "action": web_action(self.route.name, args, details, include_sources),
                }
            )
            .action
        )
        self.done("completed" if ok else "failed")


class CodeInterpreterCall(ToolCallItem):
    @classmethod
    def open(cls, events: ResponseEvents, route: Route, container_id: str) -> CodeInterpreterCall:
        return cls(CodeInterpreterWriter(events, container_id), route)

    def running(self, args: dict) -> None:
        self.writer.interpreting()

    def finished(self, ok: bool, text: str, args: dict, details: dict, include: set[str]) -> None:
        logs = text if "code_interpreter_call.outputs" in include else None
        self.writer.done("completed" if ok else "failed", logs=logs)


class McpCall(ToolCallItem):
    @classmethod
    def open(cls, events: ResponseEvents, route: Route, container_id: str) -> McpCall:
        return cls(McpCallWriter(events, route.label, route.name), route)

    @property
    def metric_label(self) -> str:
        return f"mcp:{self.route.label}"

    def running(self, args: dict) -> None:
        self.writer.calling()

    def finished(self, ok: bool, text: str, args: dict, details: dict, include: set[str]) -> None:
        self.writer.done("completed" if ok else "failed", output=text if ok else None, error=None if ok else text)


TOOL_ITEMS: dict[str, type[ToolCallItem]] = {
    "function": ClientToolCall,
    "browser": WebSearchCall,
    "python": CodeInterpreterCall,
    "mcp": McpCall,
}


def open_tool_item(events: ResponseEvents, route: Route, container_id: str) -> ToolCallItem | None:
    """The item for a call `route` leads to, its added event emitted; None for a tool that does
    not exist (the loop keeps the text as a message, marked incomplete)."""
    kind = TOOL_ITEMS.get(route.kind)
    return kind.open(events, route, container_id) if kind is not None else None


def web_action(name: str, args: dict, details: dict, include_sources: bool) -> dict:
    """The web_search_call action for browser.search / open / find."""
    url = details.get("url") or (args.get("id") if isinstance(args.get("id"), str) else None)
    if name == "open":
        return {"type": "open_page", "url": url}
    if name == "find":
        return {"type": "find_in_page", "pattern": str(args.get("pattern", "")), "url": url or ""}
    action: dict[str, Any] = {"type": "search", "query": str(args.get("query", ""))}
    if include_sources:
        sources = []
        for source in details.get("sources") or []:
            link = source.get("url") if isinstance(source, dict) else getattr(source, "url", source)
            if isinstance(link, str):
                sources.append({"type": "url", "url": link})
        action["sources"] = sources
    return action
