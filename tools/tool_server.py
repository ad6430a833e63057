"""The contract between the agent loop and the tools, and the factory that starts them.

A `ToolServer` is one Harmony namespace the model can call into: the built-in `browser` and
`python`, or the tools of one MCP server. Per response (one run of the agent loop) the loop
opens one `ToolSession` per server; the session holds what must live across the calls of that
response (the browser's page stack, the Python process and its variables) and is closed at the
end. `ToolSessionGroup` bundles the sessions of several servers behind the same interface,
routing each call by its namespace.

Sessions never raise from `call`: every failure becomes a `ToolResult` with `is_error=True`
whose text the model sees, so a response always completes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import openai_harmony

    from .python_sandbox import SandboxLimits

logger = logging.getLogger(__name__)


@dataclass
class ToolResult:
    text: str  # what the model sees as the tool message content
    is_error: bool = False
    # Structured details for the API layer:
    #   browser: {"action": "search"|"open"|"find", "cursor", "query", "url", "title",
    #             "pattern", "sources": [{"url", "title"}]}
    #   python:  {"code", "stdout", "stderr", "status": "ok"|"error"|"timeout"|"crashed",
    #             "exit": 0 | 1 | worker exit status}
    #   mcp:     {"server_label", "name", "arguments", "output", "error"}
    details: dict = field(default_factory=dict)


class ToolSession(Protocol):
    """Tool state for one response. `recipient` is the Harmony recipient the model wrote, e.g.
    "browser.search", "python", "<mcp_label>.<tool>"; `arguments` the raw text of its message
    (JSON for the browser and MCP tools, code for python)."""

    async def call(self, recipient: str, arguments: str) -> ToolResult: ...

    def resolve_citations(self, text: str) -> tuple[str, list[dict]]:
        """Final answer text -> (text for the user, url_citation annotations indexing into it)."""
        ...

    async def close(self) -> None: ...


class ToolServer(Protocol):
    name: str  # namespace: "browser", "python", or the MCP server's label
    kind: str  # "browser" | "python" | "mcp"

    def harmony_namespace(self) -> openai_harmony.ToolNamespaceConfig: ...

    def open_session(self) -> ToolSession: ...

    async def aclose(self) -> None: ...


def namespace_of(recipient: str) -> str:
    """ "browser.search" -> "browser", "python" -> "python"."""
    return recipient.split(".", 1)[0]


class ToolSessionGroup:
    """The sessions of several servers as one `ToolSession`, routing calls by namespace."""

    def __init__(self, servers: Sequence[ToolServer]):
        self.sessions: dict[str, ToolSession] = {s.name: s.open_session() for s in servers}

    def handles(self, recipient: str) -> bool:
        return namespace_of(recipient) in self.sessions

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        session = self.sessions.get(namespace_of(recipient))
        if session is None:
            known = ", ".join(sorted(self.sessions)) or "none"
            return ToolResult(f"Unknown tool `{recipient}`. Available namespaces: {known}.",
                              is_error=True)
        return await session.call(recipient, arguments)

    def resolve_citations(self, text: str) -> tuple[str, list[dict]]:
        # Only the browser cites; the others return the text unchanged and no annotations.
        annotations: list[dict] = []
        for session in self.sessions.values():
            text, found = session.resolve_citations(text)
            annotations = found or annotations
        return text, annotations

    async def close(self) -> None:
        for session in self.sessions.values():
            try:
                await session.close()
            except Exception:  # noqa: BLE001 - closing one must not keep the others open
                logger.exception("closing a tool session failed")


class ToolServerError(RuntimeError):
    """A tool server named on the command line could not be started."""


def split_specs(specs: Sequence[str]) -> list[str]:
    """`["demo", "a:1,b:2"]` -> `["demo", "a:1", "b:2"]` (the flag repeats or takes a list)."""
    return [part.strip() for spec in specs for part in spec.split(",") if part.strip()]


BUILT_IN = ("demo", "browser", "python")


def check_specs(specs: Sequence[str], *, timeout: float = 5.0) -> None:
    """Check `--tool-server` values before anything starts: each is a built-in name or an MCP
    server's address that accepts connections. ToolServerError (one line, naming the value) if not."""
    from .mcp_client import parse_mcp_spec, unreachable

    for spec in split_specs(specs):
        if spec in BUILT_IN:
            continue
        try:
            _, url = parse_mcp_spec(spec)
        except ValueError as e:
            raise ToolServerError(str(e)) from None
        reason = unreachable(url, timeout)
        if reason is not None:
            raise ToolServerError(f"cannot reach the MCP server {spec!r} at {url}: {reason}")


async def start_tool_servers(
    specs: Sequence[str],
    *,
    search_dir: str | os.PathLike | None = None,
    exa_api_key: str | None = None,
    exa_base_url: str | None = None,
    python_limits: SandboxLimits | None = None,
    mcp_timeout: float = 60.0,
) -> list[ToolServer]:
    """Start the tool servers `--tool-server` names.

    - "demo": the built-in browser and python, in-process ("browser" or "python" alone also
      work). The browser searches the folder `search_dir` when given, else the web through Exa
      when an Exa key is given or in EXA_API_KEY, else a small bundled folder of documents:
      this project's README and BENCHMARKS, and three pages about gpt-oss (`tools/browser/demo_corpus`).
    - "host:port", "http(s)://host:port/path" or "label=<either>": an MCP server over
      streamable HTTP (path "/mcp" when none is given), its tools listed now.
    Raises `ToolServerError` (after closing what it started) if one cannot be started.
    """
    from .browser.server import BrowserToolServer
    from .mcp_client import McpToolServer, parse_mcp_spec
    from .python_tool import PythonToolServer

    servers: list[ToolServer] = []
    try:
        for spec in split_specs(specs):
            if spec in ("demo", "browser") and not any(s.kind == "browser" for s in servers):
                servers.append(await BrowserToolServer.start(
                    search_dir=search_dir,
                    exa_api_key=exa_api_key or os.environ.get("EXA_API_KEY"),
                    exa_base_url=exa_base_url))
            if spec in ("demo", "python") and not any(s.kind == "python" for s in servers):
                servers.append(await PythonToolServer.start(python_limits))
            if spec in BUILT_IN:
                continue
            label, url = parse_mcp_spec(spec)
            taken = {s.name for s in servers} | {"browser", "python", "functions"}
            servers.append(await McpToolServer.start(url, label=label, taken_names=taken,
                                                     timeout=mcp_timeout))
    except BaseException as e:
        for server in servers:
            await server.aclose()
        if isinstance(e, ToolServerError) or not isinstance(e, Exception):
            raise
        raise ToolServerError(f"could not start tool server: {e}") from e
    return servers
