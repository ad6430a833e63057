"""The tool servers `--tool-server` names, started: the built-in browser and python, and MCP servers."""

from __future__ import annotations

import os
from typing import Sequence

from tools.browser.server import BrowserToolServer
from tools.mcp_client import McpToolServer, parse_mcp_spec, unreachable
from tools.protocol import ToolServer
from tools.python.sandbox import SandboxLimits
from tools.python.server import PythonToolServer


class ToolServerError(RuntimeError):
    """A tool server named on the command line could not be started."""


def split_specs(specs: Sequence[str]) -> list[str]:
    """`["demo", "a:1,b:2"]` -> `["demo", "a:1", "b:2"]` (the flag repeats or takes a list)."""
    return [part.strip() for spec in specs for part in spec.split(",") if part.strip()]


BUILT_IN = ("demo", "browser", "python")


def check_specs(specs: Sequence[str], *, timeout: float = 5.0) -> None:
    """Check `--tool-server` values before anything starts: each is a built-in name or an MCP
    server's address that accepts connections. ToolServerError (one line, naming the value) if not."""
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
    servers: list[ToolServer] = []
    try:
        for spec in split_specs(specs):
            if spec in ("demo", "browser") and not any(s.kind == "browser" for s in servers):
                servers.append(
                    await BrowserToolServer.start(
                        search_dir=search_dir,
                        exa_api_key=exa_api_key or os.environ.get("EXA_API_KEY"),
                        exa_base_url=exa_base_url,
                    )
                )
            if spec in ("demo", "python") and not any(s.kind == "python" for s in servers):
                servers.append(await PythonToolServer.start(python_limits))
            if spec in BUILT_IN:
                continue
            label, url = parse_mcp_spec(spec)
            taken = {s.name for s in servers} | {"browser", "python", "functions"}
            servers.append(await McpToolServer.start(url, label=label, taken_names=taken, timeout=mcp_timeout))
    except BaseException as e:
        for server in servers:
            await server.aclose()
        if isinstance(e, ToolServerError) or not isinstance(e, Exception):
            raise
        raise ToolServerError(f"could not start tool server: {e}") from e
    return servers
