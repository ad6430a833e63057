"""Tools from external MCP servers (`--tool-server host:port`), over streamable HTTP.

At start the server's tools are listed once; they become one Harmony namespace named after
the server (its label), so the model calls `<label>.<tool>` with JSON arguments, and the API
layer can show them to clients as an `mcp_list_tools` item (`listed_tools()`). Calls are
forwarded with the `mcp` SDK's client; the server's result content becomes the tool message.
A call that fails because the connection broke is retried once on a fresh connection.

The SDK's client is an async context manager built on anyio task groups, which must be
entered and exited by the same task; a background task owns the connection for its whole
life, and calls from any task go through the client it opened.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import urlparse

import mcp_types
from mcp import Client
from mcp.shared.exceptions import MCPError
from openai_harmony import ToolDescription, ToolNamespaceConfig

from tools.protocol import ToolResult

if sys.version_info < (3, 11):  # a builtin from 3.11; anyio brings the backport before
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)

DEFAULT_PATH = "/mcp"
SPEC_FORMS = "demo, browser, python, host:port, an http(s):// URL, or label=<host:port or URL>"
LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
MAX_OUTPUT_CHARS = 32_000


@dataclass
class McpTool:
    name: str
    description: str
    input_schema: dict
    annotations: dict | None = None


def parse_mcp_spec(spec: str) -> tuple[str | None, str]:
    """ "label=URL", "URL" or "host:port" -> (label or None, endpoint URL)."""
    label = None
    head, sep, rest = spec.partition("=")
    if sep and LABEL.match(head) and "/" not in head:
        label, spec = head, rest
    if "://" in spec:
        parsed = urlparse(spec)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"not an MCP server URL: {spec!r}")
        return label, spec if parsed.path not in ("", "/") else spec.rstrip("/") + DEFAULT_PATH
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected {SPEC_FORMS} for a tool server, got {spec!r}")
    return label, f"http://{host}:{port}{DEFAULT_PATH}"


def unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why nothing accepts connections at `url`'s host and port (one line), or None: the cheap
    check that a server is there at all, before the MCP handshake."""
    import socket

    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__
    return None


def namespace_name(label: str, taken: Iterable[str]) -> str:
    """A Harmony namespace name from a label: word characters only, not already in use."""
    name = re.sub(r"\W+", "_", label).strip("_") or "mcp"
    if name[0].isdigit():
        name = "mcp_" + name
    taken = set(taken)
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    return candidate


def without_titles(schema: Any) -> Any:
    """A JSON schema without "title" keys. pydantic-based servers title every property with
    its own name, which Harmony would render as a comment line per parameter."""
    if isinstance(schema, dict):
        return {k: without_titles(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [without_titles(v) for v in schema]
    return schema


def content_text(result: mcp_types.CallToolResult) -> str:
    """What the model sees of a tool result: its text, placeholders for media, else the
    structured content as JSON."""
    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, (mcp_types.ImageContent, mcp_types.AudioContent)):
            parts.append(f"[{block.type}: {block.mime_type}]")
        elif isinstance(block, mcp_types.EmbeddedResource):
            resource = block.resource
            if isinstance(resource, mcp_types.TextResourceContents):
                parts.append(resource.text)
            else:
                parts.append(f"[resource {resource.uri}: {resource.mime_type or 'binary'}]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource link: {block.name} {block.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + f"\n[... {len(text) - MAX_OUTPUT_CHARS} characters omitted]"
    return text


def describe_error(error: BaseException) -> str:
    """The innermost cause of an anyio task group failure, in one line."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _Connection:
    """One open MCP client session, owned by a background task."""

    def __init__(self, url: str, timeout: float):
        self.url = url
        self.timeout = timeout
        self.client: Client | None = None
        self.server_info: mcp_types.Implementation | None = None
        self.instructions: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def open(self) -> list[mcp_types.Tool]:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(ready), name=f"mcp {self.url}")
        try:
            return await asyncio.wait_for(asyncio.shield(ready), self.timeout)
        except BaseException:
            await self.close()
            raise

    async def _run(self, ready: asyncio.Future) -> None:
        try:
            async with Client(self.url, read_timeout_seconds=self.timeout) as client:
                tools: list[mcp_types.Tool] = []
                cursor = None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                self.client = client
                self.server_info = client.server_info
                self.instructions = client.instructions
                ready.set_result(tools)
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported through `ready` or the next call
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else ConnectionError(str(e)))
            elif not self._stop.is_set():
                logger.warning("MCP connection to %s ended: %s", self.url, describe_error(e))
        finally:
            self.client = None

    @property
    def alive(self) -> bool:
        return self.client is not None and self._task is not None and not self._task.done()

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except BaseException:  # noqa: BLE001 - closing is best effort
                self._task.cancel()
        self.client = None


class McpToolServer:
    kind = "mcp"

    def __init__(
        self, url: str, name: str, tools: list[McpTool], connection: _Connection, description: str, timeout: float
    ):
        self.url = url
        self.name = name
        self.tools = tools
        self.description = description
        self.timeout = timeout
        self._connection = connection
        self._reconnect_lock = asyncio.Lock()

    @classmethod
    async def start(
        cls, url: str, *, label: str | None = None, taken_names: Iterable[str] = (), timeout: float = 60.0
    ) -> McpToolServer:
        connection = _Connection(url, timeout)
        try:
            listed = await connection.open()
        except Exception as e:
            raise ConnectionError(f"cannot reach the MCP server at {url}: {describe_error(e)}") from e
        info = connection.server_info
        name = namespace_name(label or (info.name if info else "") or urlparse(url).hostname or "mcp", taken_names)
        tools = [
            McpTool(
                name=t.name,
                description=t.description or t.title or "",
                input_schema=dict(t.input_schema or {"type": "object"}),
                annotations=t.annotations.model_dump(exclude_none=True) if t.annotations else None,
            )
            for t in listed
        ]
        description = (
            connection.instructions
            or (info.description if info else None)
            or f"Tools from the MCP server {info.name if info else url}."
        )
        logger.info("MCP server %s at %s: %d tools (%s)", name, url, len(tools), ", ".join(t.name for t in tools))
        return cls(url, name, tools, connection, description, timeout)

    def listed_tools(self) -> list[dict]:
        """The tools as the Responses API's `mcp_list_tools` item lists them."""
        return [
            {"name": t.name, "description": t.description, "input_schema": t.input_schema, "annotations": t.annotations}
            for t in self.tools
        ]

    def harmony_namespace(self) -> ToolNamespaceConfig:
        return ToolNamespaceConfig(
            name=self.name,
            description=self.description,
            tools=[
                ToolDescription.new(t.name, t.description, parameters=without_titles(t.input_schema))
                for t in self.tools
            ],
        )

    def open_session(self) -> McpToolSession:
        return McpToolSession(self)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        """Forward one call; on a broken connection, reconnect and try once more."""
        for attempt in range(2):
            connection = await self._live_connection()
            try:
                return await asyncio.wait_for(
                    connection.client.call_tool(name, arguments, read_timeout_seconds=self.timeout), self.timeout
                )
            except (asyncio.TimeoutError, TimeoutError):
                raise
            except Exception as e:
                if attempt or (isinstance(e, MCPError) and e.code != mcp_types.CONNECTION_CLOSED):
                    raise  # the server answered with an error, or the retry failed too
                logger.warning("MCP call %s.%s failed; reconnecting to %s", self.name, name, self.url)
                await self._reconnect(connection)
        raise AssertionError("unreachable")

    async def _live_connection(self) -> _Connection:
        if not self._connection.alive:
            await self._reconnect(self._connection)
        return self._connection

    async def _reconnect(self, broken: _Connection) -> None:
        async with self._reconnect_lock:
            if self._connection is not broken:
                return  # another call already reconnected
            await broken.close()
            connection = _Connection(self.url, self.timeout)
            await connection.open()
            self._connection = connection

    async def aclose(self) -> None:
        await self._connection.close()


class McpToolSession:
    def __init__(self, server: McpToolServer):
        self.server = server

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        namespace, _, tool = recipient.partition(".")
        details: dict[str, Any] = {
            "server_label": self.server.name,
            "name": tool,
            "arguments": arguments,
            "output": None,
            "error": None,
        }
        known = [t.name for t in self.server.tools]
        if namespace != self.server.name or tool not in known:
            details["error"] = f"Unknown tool `{recipient}`. {self.server.name} has: {', '.join(known) or 'no tools'}."
            return ToolResult(details["error"], is_error=True, details=details)
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            parsed = e
        if not isinstance(parsed, dict):
            details["error"] = "Invalid arguments: expected a JSON object."
            return ToolResult(details["error"], is_error=True, details=details)
        try:
            result = await self.server.call_tool(tool, parsed)
        except (asyncio.TimeoutError, TimeoutError):
            details["error"] = f"The tool `{recipient}` did not answer within {self.server.timeout:g} seconds."
            return ToolResult(details["error"], is_error=True, details=details)
        except Exception as e:  # noqa: BLE001 - shown to the model
            details["error"] = f"Calling `{recipient}` failed: {describe_error(e)}"
            return ToolResult(details["error"], is_error=True, details=details)
        text = content_text(result)
        details["error" if result.is_error else "output"] = text
        return ToolResult(text, is_error=bool(result.is_error), details=details)

    def resolve_citations(self, text: str) -> tuple[str, list[dict]]:
        return text, []

    async def close(self) -> None:
        pass
