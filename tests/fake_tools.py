"""Small deterministic tool servers (browser, python, MCP) for server tests.

They follow `tools.protocol`'s protocol (`ToolServer`, `ToolSession`, `ToolResult`) with
canned behaviour, so a test knows exactly what the model "saw" and which citations resolve.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

from openai_harmony import ToolDescription, ToolNamespaceConfig

from tools.protocol import ToolResult

PAGES = [
    ("https://example.org/oss", "gpt-oss release notes"),
    ("https://example.org/harmony", "The Harmony format"),
]
CITATION = re.compile(r"【(\d+)†L(\d+)(?:-L(\d+))?】")


class FakeBrowserSession:
    def __init__(self, server: "FakeBrowser"):
        self.server = server
        self.closed = False

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        self.server.calls.append((recipient, arguments))
        args = json.loads(arguments or "{}")
        if recipient == "browser.search":
            lines = [f"【{i}†{title}†{url}】" for i, (url, title) in enumerate(PAGES)]
            text = f"# Search results for {args.get('query')!r}\n" + "\n".join(lines)
            return ToolResult(
                text,
                details={
                    "action": "search",
                    "query": args.get("query"),
                    "sources": [{"url": u, "title": t} for u, t in PAGES],
                },
            )
        if recipient == "browser.open":
            url, title = PAGES[int(args.get("id", 0))]
            return ToolResult(f"[0] {title}\nURL: {url}\nL0: Lorem ipsum.", details={"action": "open", "url": url})
        return ToolResult(f"Unknown browser tool {recipient}", is_error=True)

    def resolve_citations(self, text: str):
        """【i†Lx-Ly】 -> "[title]" with a url_citation over that span."""
        out, annotations, last = "", [], 0
        for m in CITATION.finditer(text):
            out += text[last : m.start()]
            url, title = PAGES[int(m.group(1)) % len(PAGES)]
            label = f"[{title}]"
            annotations.append(
                {
                    "type": "url_citation",
                    "url": url,
                    "title": title,
                    "start_index": len(out),
                    "end_index": len(out) + len(label),
                }
            )
            out += label
            last = m.end()
        return out + text[last:], annotations

    async def close(self) -> None:
        self.closed = True


class FakeBrowser:
    name = "browser"
    kind = "browser"
    live_web = False  # its canned pages stand for a local search backend

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.sessions: list[FakeBrowserSession] = []

    def harmony_namespace(self) -> ToolNamespaceConfig:
        return ToolNamespaceConfig.browser()

    def open_session(self) -> FakeBrowserSession:
        self.sessions.append(FakeBrowserSession(self))
        return self.sessions[-1]

    async def aclose(self) -> None:
        pass


class FakePythonSession:
    def __init__(self, server: "FakePython"):
        self.server = server
        self.globals: dict = {}

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        self.server.calls.append(arguments)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(arguments, self.globals)  # test-authored code only
        except Exception as e:
            return ToolResult(f"{out.getvalue()}{type(e).__name__}: {e}", is_error=True)
        return ToolResult(out.getvalue(), details={"code": arguments, "stdout": out.getvalue(), "status": "ok"})

    def resolve_citations(self, text: str):
        return text, []

    async def close(self) -> None:
        pass


class FakePython:
    name = "python"
    kind = "python"

    def __init__(self):
        self.calls: list[str] = []

    def harmony_namespace(self) -> ToolNamespaceConfig:
        return ToolNamespaceConfig.python()

    def open_session(self) -> FakePythonSession:
        return FakePythonSession(self)

    async def aclose(self) -> None:
        pass


class FakeMcpSession:
    def __init__(self, server: "FakeMcp"):
        self.server = server

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        self.server.calls.append((recipient, arguments))
        city = json.loads(arguments or "{}").get("city", "?")
        if city == "Atlantis":
            return ToolResult("No forecast for Atlantis.", is_error=True)
        return ToolResult(f"Sunny in {city}, 21°C.")

    def resolve_citations(self, text: str):
        return text, []

    async def close(self) -> None:
        pass


class FakeMcp:
    kind = "mcp"

    def __init__(self, name: str = "weather"):
        self.name = name
        self.calls: list[tuple[str, str]] = []

    def harmony_namespace(self) -> ToolNamespaceConfig:
        forecast = ToolDescription.new(
            "get_forecast",
            "Weather forecast for a city",
            parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        )
        return ToolNamespaceConfig(name=self.name, description="Weather tools", tools=[forecast])

    def open_session(self) -> FakeMcpSession:
        return FakeMcpSession(self)

    async def aclose(self) -> None:
        pass
