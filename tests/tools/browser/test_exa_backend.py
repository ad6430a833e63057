"""The Exa backend through the real `exa-py` client against a fake Exa API on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tools.browser.backend import RetryPolicy
from tools.browser.exa_backend import ExaBackend
from tools.browser.session import BrowserSession
from tools.servers import start_tool_servers

API_KEY = "test-exa-key"
ARTICLE_URL = "https://www.example.org/sky"
ARTICLE_HTML = """<html><head><title>Why the sky is blue</title></head><body>
<h1>Why the sky is blue</h1>
<p>Sunlight is scattered by the molecules of the air. Blue light is scattered more than red
light because it has a shorter wavelength; this is called
<a href="/wiki/Rayleigh_scattering">Rayleigh scattering</a>.</p>
<p>See also <a href="https://physics.example.com/optics">an optics primer</a>.</p>
<script>var tracking = 1;</script>
</body></html>"""


@dataclass
class FakeExa:
    """Scripted answers: each entry of `script[path]` is (status, json body, delay seconds),
    used in order, the last one repeating."""

    script: dict[str, list[tuple[int, dict, float]]] = field(default_factory=dict)
    requests: list[tuple[str, dict, dict]] = field(default_factory=list)

    def count(self, path: str) -> int:
        return sum(1 for p, _, _ in self.requests if p == path)

    async def handle(self, request: Request) -> JSONResponse:
        path = request.url.path
        self.requests.append((path, dict(request.headers), await request.json()))
        answers = self.script[path]
        status, body, delay = answers.pop(0) if len(answers) > 1 else answers[0]
        if delay:
            await asyncio.sleep(delay)
        return JSONResponse(body, status_code=status)


def search_body(n: int = 3) -> dict:
    return {
        "requestId": "r1",
        "results": [
            {
                "id": f"doc{i}",
                "url": ARTICLE_URL if i == 0 else f"https://site{i}.example.com/page",
                "title": "Why the sky is blue" if i == 0 else f"Result number {i}",
                "highlights": [f"Highlight {i} about Rayleigh scattering.", "Second sentence."],
                "highlightScores": [0.9, 0.5],
            }
            for i in range(n)
        ],
    }


CONTENTS_BODY = {
    "requestId": "r2",
    "results": [{"id": "doc0", "url": ARTICLE_URL, "title": "Why the sky is blue", "text": ARTICLE_HTML}],
}


@pytest.fixture
async def fake_exa():
    fake = FakeExa()
    app = Starlette(
        routes=[Route("/search", fake.handle, methods=["POST"]), Route("/contents", fake.handle, methods=["POST"])]
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    fake.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield fake
    server.should_exit = server.force_exit = True  # don't wait for a deliberately slow answer
    await task


def backend_for(fake: FakeExa, **options) -> ExaBackend:
    options.setdefault("retry", RetryPolicy(attempts=3, base_delay=0.01))
    return ExaBackend(API_KEY, base_url=fake.base_url, **options)


def words(text: str) -> int:
    return len(text.split()) + 1


async def test_search_open_and_cite_through_the_sdk(fake_exa):
    fake_exa.script = {"/search": [(200, search_body(), 0)], "/contents": [(200, CONTENTS_BODY, 0)]}
    backend = backend_for(fake_exa)
    session = BrowserSession(backend, count_tokens=words)

    result = await session.call("browser.search", '{"query": "why is the sky blue", "topn": 3}')
    assert not result.is_error, result.text
    path, headers, body = fake_exa.requests[0]
    assert path == "/search" and headers["x-api-key"] == API_KEY
    assert body["query"] == "why is the sky blue" and body["numResults"] == 3
    assert body["contents"]["highlights"] is True
    lines = result.text.split("\n")
    assert lines[0] == "[0] why is the sky blue"
    assert lines[1] == "**viewing lines [0 - 9] of 9**"
    assert "L4:   * 【0†Why the sky is blue†www.example.org】 Highlight 0 about Rayleigh" in result.text
    assert "【2†Result number 2†site2.example.com】" in result.text
    assert result.details["sources"][1] == {"url": "https://site1.example.com/page", "title": "Result number 1"}

    result = await session.call("browser.open", '{"id": 0}')
    assert not result.is_error, result.text
    path, _, body = fake_exa.requests[1]
    assert path == "/contents" and body["urls"] == [ARTICLE_URL]
    assert body["text"]["includeHtmlTags"] is True
    assert result.text.startswith(f"[1] Why the sky is blue ({ARTICLE_URL})\n**viewing lines [0 - ")
    assert "L1: URL: https://www.example.org/sky" in result.text
    assert "# Why the sky is blue" in result.text
    # Links: same site without a domain, other sites with theirs; scripts are gone.
    page_text = session.pages[1].text
    assert "this is called 【0†Rayleigh scattering】." in page_text
    assert "【1†an optics primer†physics.example.com】" in result.text
    assert "tracking" not in page_text
    assert session.pages[1].links[0] == "https://www.example.org/wiki/Rayleigh_scattering"

    # Opening the same result again uses the session's cache, not the API.
    await session.call("browser.open", '{"cursor": 0, "id": 0}')
    assert fake_exa.count("/contents") == 1

    line = next(i for i, text in enumerate(session.pages[1].lines) if "Rayleigh" in text)
    # L6 of the results page is result 1's line; L7 continues it (wrapped).
    answer = f"Shorter wavelengths scatter more【1†L{line}-L{line + 1}】. Also【0†L7】."
    text, annotations = session.resolve_citations(answer)
    page_link = f"([www.example.org]({ARTICLE_URL}))"
    second_link = "([site1.example.com](https://site1.example.com/page))"
    assert text == f"Shorter wavelengths scatter more {page_link}. Also {second_link}."
    assert [a["url"] for a in annotations] == [ARTICLE_URL, "https://site1.example.com/page"]
    for annotation in annotations:
        assert text[annotation["start_index"] : annotation["end_index"]] in (page_link, second_link)
    assert annotations[0]["title"] == "Why the sky is blue"
    assert annotations[1]["title"] == "Result number 1"
    await backend.aclose()


async def test_rate_limits_and_server_errors_are_retried(fake_exa):
    fake_exa.script = {
        "/search": [(429, {"error": "slow down"}, 0), (503, {"error": "busy"}, 0), (200, search_body(2), 0)]
    }
    backend = backend_for(fake_exa)
    hits = await backend.search("retry me", 2)
    assert [h.title for h in hits] == ["Why the sky is blue", "Result number 1"]
    assert fake_exa.count("/search") == 3
    await backend.aclose()


async def test_persistent_server_error_becomes_a_tool_error(fake_exa):
    fake_exa.script = {"/search": [(500, {"error": "internal"}, 0)]}
    backend = backend_for(fake_exa)
    session = BrowserSession(backend, count_tokens=words)
    result = await session.call("browser.search", '{"query": "anything"}')
    assert result.is_error
    assert result.text.startswith("Error during search for `anything`:")
    assert "500" in result.text and "gave up after 3 attempts" in result.text
    assert fake_exa.count("/search") == 3
    assert session.pages == []  # a failed search pushes no page
    await backend.aclose()


async def test_client_errors_are_not_retried(fake_exa):
    fake_exa.script = {"/search": [(401, {"error": "invalid API key"}, 0)]}
    backend = backend_for(fake_exa)
    session = BrowserSession(backend, count_tokens=words)
    result = await session.call("browser.search", '{"query": "anything"}')
    assert result.is_error and "401" in result.text and "invalid API key" in result.text
    assert fake_exa.count("/search") == 1
    await backend.aclose()


async def test_timeout_becomes_a_tool_error_quickly(fake_exa):
    fake_exa.script = {"/search": [(200, search_body(), 3.0)]}
    backend = backend_for(fake_exa, timeout=0.3)
    session = BrowserSession(backend, count_tokens=words)
    start = time.monotonic()
    result = await session.call("browser.search", '{"query": "slow"}')
    assert time.monotonic() - start < 2.0
    assert result.is_error and "timed out after 0.3s" in result.text
    assert fake_exa.count("/search") == 1
    await backend.aclose()


async def test_unreachable_api_becomes_a_tool_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    backend = ExaBackend(API_KEY, base_url=f"http://127.0.0.1:{port}", retry=RetryPolicy(attempts=2, base_delay=0.01))
    session = BrowserSession(backend, count_tokens=words)
    result = await session.call("browser.open", '{"id": "https://example.com/"}')
    assert result.is_error
    assert result.text.startswith("Error fetching URL `https://example.com/`: ConnectError")
    assert "gave up after 2 attempts" in result.text
    await backend.aclose()


async def test_fetch_with_no_contents_and_plain_text_pages(fake_exa):
    fake_exa.script = {
        "/contents": [
            (200, {"results": [], "statuses": []}, 0),
            (200, {"results": [{"url": "https://e.com/t", "title": "T", "text": "line one\nline two"}]}, 0),
        ]
    }
    backend = backend_for(fake_exa)
    session = BrowserSession(backend, count_tokens=words)
    result = await session.call("browser.open", '{"id": "https://e.com/missing"}')
    assert result.is_error and "no contents returned" in result.text
    result = await session.call("browser.open", '{"id": "https://e.com/t"}')
    assert "L2: line one\nL3: line two" in result.text
    await backend.aclose()


async def test_demo_tool_server_uses_exa_when_given_a_key(fake_exa):
    fake_exa.script = {"/search": [(200, search_body(1), 0)]}
    servers = await start_tool_servers(["browser"], exa_api_key=API_KEY, exa_base_url=fake_exa.base_url)
    try:
        (browser,) = servers
        assert "sources=web (default: web)" in browser.harmony_namespace().description
        session = browser.open_session()
        result = await session.call("browser.search", '{"query": "sky"}')
        assert "【0†Why the sky is blue†www.example.org】" in result.text
        assert fake_exa.requests[0][1]["x-api-key"] == API_KEY
    finally:
        for server in servers:
            await server.aclose()
