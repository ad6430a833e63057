"""The contract between the agent loop and the tools (`tools/servers.py` starts them).

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import openai_harmony

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
            return ToolResult(f"Unknown tool `{recipient}`. Available namespaces: {known}.", is_error=True)
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
