"""Which tools a request may use, where each Harmony recipient goes, and the tool sessions.

The server is started with some tool servers (`tools.protocol`: browser, python, MCP). A
request enables a subset: `web_search` (any alias) -> the browser namespace, `code_interpreter` ->
python, `mcp` (by `server_label`) -> that MCP server; the client's own tools (function, custom,
namespace, local_shell) are described by `client_tools`. The model addresses them by recipient:
"browser.search", "python", "<mcp namespace>.<tool>", "functions.<name>", "<namespace>.<name>".
Sessions (browser pages, a Python kernel) live as long as one response.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any

from openai_harmony import ToolDescription, ToolNamespaceConfig

from agent_server.client_tools import ClientTool, ClientTools
from agent_server.errors import APIError
from agent_server.harmony import recipient_kind
from agent_server.turn_grammar import CallTarget, function_arguments
from schemas.responses import (
    CodeInterpreterTool,
    McpApprovalFilter,
    McpTool,
    McpToolFilter,
    ToolChoiceAllowed,
    ToolChoiceBuiltin,
    ToolChoiceCustom,
    ToolChoiceFunction,
    ToolChoiceMcp,
    WebSearchTool,
)
from tools.protocol import ToolServer, ToolSession

# The browser's arguments as the turn grammar holds them: Harmony's browser tool schemas, with
# bounds no real call comes near (a model that wanders, or a random one, still ends its call).
_COUNT = {"type": "integer", "minimum": -1, "maximum": 1_000_000}
BROWSER_ARGUMENTS: dict[str, dict[str, Any]] = {
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 256},
            "topn": {"type": "integer", "minimum": 1, "maximum": 50},
            "source": {"type": "string", "maxLength": 64},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
    "open": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [_COUNT, {"type": "string", "maxLength": 2048}]},
            "cursor": _COUNT,
            "loc": _COUNT,
            "num_lines": _COUNT,
            "view_source": {"type": "boolean"},
            "source": {"type": "string", "maxLength": 64},
        },
        "additionalProperties": False,
    },
    "find": {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "minLength": 1, "maxLength": 256},
            "cursor": _COUNT,
        },
        "required": ["pattern"],
        "additionalProperties": False,
    },
}


@dataclass
class McpBinding:
    label: str  # the request's server_label
    server: ToolServer
    namespace: ToolNamespaceConfig  # only the allowed tools


@dataclass
class Route:
    kind: str  # "function" | "browser" | "python" | "mcp" | "unknown"
    name: str  # function or tool name within its namespace
    server: ToolServer | None = None
    label: str = ""  # MCP server_label
    client: ClientTool | None = None  # kind "function": the client's tool called, if it is one


@dataclass
class ActiveTools:
    """The tools one request enabled."""

    client: ClientTools = field(default_factory=ClientTools)
    browser: ToolServer | None = None
    python: ToolServer | None = None
    mcp: dict[str, McpBinding] = field(default_factory=dict)  # by Harmony namespace name

    @property
    def any_builtin(self) -> bool:
        return bool(self.browser or self.python or self.mcp)

    def namespaces(self) -> list[ToolNamespaceConfig]:
        """Namespaces for the system message, browser and python first as gpt-oss expects."""
        spaces = [s.harmony_namespace() for s in (self.browser, self.python) if s is not None]
        return spaces + [b.namespace for b in self.mcp.values()] + self.client.namespaces

    def call_targets(self, *, forced: bool = False) -> list[CallTarget]:
        """Every recipient the model may address, with what its message holds (`turn_grammar.py`):
        the client's tools on commentary (a custom tool with a grammar: text of that grammar, in
        every turn), built-ins and MCP tools on analysis (their forced headers).
        `forced`: as the targets of a forced call (a function's schema then holds where it
        compiles, strict or not)."""
        targets = [
            CallTarget(recipient, "commentary", code=True, grammar=t.text_grammar)
            if t.text_grammar is not None
            else CallTarget(recipient, "commentary", function_arguments(t.parameters, strict=t.strict, forced=forced))
            for recipient, t in self.client.by_recipient.items()
        ]
        if self.browser is not None:
            name = self.browser.harmony_namespace().name
            targets += [
                CallTarget(f"{name}.{tool}", "analysis", args, fits_budget=True)
                for tool, args in BROWSER_ARGUMENTS.items()
            ]
        if self.python is not None:
            targets.append(CallTarget(self.python.harmony_namespace().name, "analysis", code=True))
        for namespace, binding in self.mcp.items():
            targets += [
                CallTarget(
                    f"{namespace}.{t.name}", "analysis", function_arguments(t.parameters, strict=False, forced=forced)
                )
                for t in binding.namespace.tools
            ]
        return targets

    def forced_targets(self, choice: Any) -> list[CallTarget]:
        """The calls a `tool_choice` forces (none for "auto" and "none"): "required" any tool (an
        `allowed_tools` choice in "required" mode: any of those it allows, the tools enabled), a
        named function or custom tool that one, a built-in tool its first call (a search, a python
        cell), an MCP server its tools (or the one named)."""
        if isinstance(choice, ToolChoiceAllowed):
            choice = choice.mode
        targets = self.call_targets(forced=True)
        if choice == "required":
            return targets
        if isinstance(choice, (ToolChoiceFunction, ToolChoiceCustom)):
            wanted = {f"functions.{choice.name}"}
        elif isinstance(choice, ToolChoiceBuiltin):
            server = self.python if choice.type == "code_interpreter" else self.browser
            if server is None:
                return []
            name = server.harmony_namespace().name
            wanted = {name if server is self.python else f"{name}.search"}
        elif isinstance(choice, ToolChoiceMcp):
            wanted = {
                f"{namespace}.{t.name}"
                for namespace, b in self.mcp.items()
                if b.label == choice.server_label
                for t in b.namespace.tools
                if choice.name in (None, t.name)
            }
        else:
            return []
        return [t for t in targets if t.recipient in wanted]

    def function_descriptions(self) -> list[ToolDescription]:
        return self.client.functions

    def route(self, recipient: str | None) -> Route:
        namespace, name = recipient_kind(recipient)
        client = self.client.by_recipient.get(f"{namespace}.{name}")
        if client is not None:
            return Route("function", client.name, client=client)
        if namespace == "functions" and name:  # a function the client did not declare: still theirs to answer
            return Route("function", name, client=ClientTool("function", name))
        for kind, server in (("browser", self.browser), ("python", self.python)):
            if server is not None and namespace == server.harmony_namespace().name:
                return Route(kind, name, server)
        if namespace in self.mcp and name:
            binding = self.mcp[namespace]
            if any(t.name == name for t in binding.namespace.tools):
                return Route("mcp", name, binding.server, binding.label)
        return Route("unknown", recipient or "")


class ToolRegistry:
    """The tool servers this process started, looked up by what requests ask for."""

    def __init__(self, servers: list[ToolServer] | None = None):
        self.servers = list(servers or [])

    def by_kind(self, kind: str) -> list[ToolServer]:
        return [s for s in self.servers if s.kind == kind]

    def select(self, tools: list[Any], *, enabled: bool = True) -> ActiveTools:
        """The request's `tools` mapped onto servers; APIError naming the tool if one is missing.

        `enabled=False` (tool_choice "none") still validates but enables nothing."""
        active = ActiveTools()
        active.client.add(tools)
        for i, tool in enumerate(tools):
            param = f"tools[{i}]"
            if isinstance(tool, WebSearchTool):
                active.browser = self._browser(tool, param)
            elif isinstance(tool, CodeInterpreterTool):
                active.python = self._one("python", tool.type, param)
            elif isinstance(tool, McpTool):
                binding = self._mcp(tool, param)
                active.mcp[binding.namespace.name] = binding
        return active if enabled else ActiveTools()

    def _browser(self, tool: WebSearchTool, param: str) -> ToolServer:
        """The browser; with `external_web_access: false` only one searching local documents."""
        server = self._one("browser", tool.type, param)
        if tool.external_web_access is False and getattr(server, "live_web", True):
            raise APIError(
                "'external_web_access': false asks for no live web access, but this server's browser "
                "searches the web; start it with a local search backend (--search-dir, or no Exa key) "
                "or allow live access.",
                param=f"{param}.external_web_access",
                code="unsupported_value",
            )
        return server

    def _one(self, kind: str, tool_type: str, param: str) -> ToolServer:
        servers = self.by_kind(kind)
        if not servers:
            raise APIError(
                f"The '{tool_type}' tool is not available: start the server with a {kind} tool server "
                f"(oss-agent serve --tool-server {kind}).",
                param=param,
                code="tool_not_available",
            )
        return servers[0]

    def _mcp(self, tool: McpTool, param: str) -> McpBinding:
        if tool.require_approval == "always" or isinstance(tool.require_approval, McpApprovalFilter):
            raise APIError(
                "MCP tool approvals are not supported; use require_approval='never'.", param=f"{param}.require_approval"
            )
        server = next((s for s in self.by_kind("mcp") if s.name == tool.server_label), None)
        if server is None:
            labels = ", ".join(s.name for s in self.by_kind("mcp")) or "none"
            raise APIError(
                f"No MCP server labelled '{tool.server_label}' runs on this server (available: {labels}); "
                "MCP servers are configured with --tool-server.",
                param=f"{param}.server_label",
                code="tool_not_available",
            )
        namespace = server.harmony_namespace()
        allowed = _allowed_names(tool.allowed_tools, server)
        if allowed is not None:
            namespace = ToolNamespaceConfig(
                name=namespace.name,
                description=namespace.description,
                tools=[t for t in namespace.tools if t.name in allowed],
            )
        return McpBinding(tool.server_label, server, namespace)


def _allowed_names(allowed: list[str] | McpToolFilter | None, server: Any) -> set[str] | None:
    """The tool names `allowed_tools` keeps (None: all). `read_only` keeps the tools the server
    marks read-only (MCP's readOnlyHint annotation): one that says nothing is not."""
    if allowed is None:
        return None
    if isinstance(allowed, list):
        return set(allowed)
    names = set(allowed.tool_names) if allowed.tool_names is not None else None
    if allowed.read_only:
        read_only = {
            t.name
            for t in getattr(server, "tools", [])
            if (getattr(t, "annotations", None) or {}).get("readOnlyHint") is True
        }
        names = read_only if names is None else names & read_only
    return names


class ToolSessions:
    """The sessions one response opened, one per server, all closed when it ends."""

    def __init__(self) -> None:
        self.sessions: dict[int, ToolSession] = {}

    async def get(self, server: ToolServer) -> ToolSession:
        key = id(server)
        if key not in self.sessions:
            session = server.open_session()
            if inspect.isawaitable(session):
                session = await session
            self.sessions[key] = session
        return self.sessions[key]

    def opened(self, server: ToolServer | None) -> ToolSession | None:
        return self.sessions.get(id(server)) if server is not None else None

    async def close(self) -> None:
        sessions, self.sessions = list(self.sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
