"""The web playground at `/`, driven in real headless Chromium (Playwright) against a live server.

The scripted engine decides what the model says, so each test knows what the page must show:
streamed text, the reasoning panel, tool steps, citations, a stopped generation, the API key
prompt. One smoke test runs the page on the real engine over the tiny random checkpoint.
Screenshots land in test-artifacts/playground/. The browser tests skip where Chromium is absent
(`bash .ci/browser.sh` installs it; `.ci/run` does so in CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests import conftest
from tests.conftest import MODEL, LiveServer, make_app
from tests.fake_engine import ScriptedEngine

pytestmark = pytest.mark.slow  # a long end-to-end run: CI runs it with `-m slow`

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "playground"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 45_000  # waits, not assertions: a loaded 2-core CI machine renders slowly

SEARCH = (
    "<|channel|>analysis<|message|>I should look this up.<|end|><|start|>assistant<|channel|>analysis "
    'to=browser.search <|constrain|>json<|message|>{"query": "gpt-oss license"}<|call|>'
)
CITED_TEXT = (
    "gpt-oss is released under the Apache-2.0 license, which allows commercial use, modification "
    "and redistribution 【0†L1-L2】."
)
CITED = (
    "<|channel|>analysis<|message|>The release notes answer it.<|end|><|start|>assistant<|channel|>final"
    f"<|message|>{CITED_TEXT}<|return|>"
)
# The chip follows the sentence's full stop (after it, the stop read as "notes ." with a space).
CITED_SHOWN = CITED_TEXT.replace(" 【0†L1-L2】.", ". gpt-oss release notes")
PYTHON = "<|channel|>analysis to=python code<|message|>print(6 * 7)<|call|>"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
MCP_TOOL = {"type": "mcp", "server_label": "weather", "require_approval": "never"}
MCP_CALL = '<|channel|>commentary to=weather.get_forecast <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
WEATHER_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


def final(text: str, reasoning: str | None = None) -> str:
    head = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
    return f"{head}<|channel|>final<|message|>{text}<|return|>"


def wait_for(predicate, timeout: float = 45.0) -> None:  # (a browser is slower than the tests' default)
    conftest.wait_for(predicate, timeout)


def prompt_text(call) -> str:
    from inference.tokenizer import harmony_encoding

    return harmony_encoding().decode(call.request.prompt_token_ids)


# --- the browser ------------------------------------------------------------------------------


def chromium_executable() -> str | None:
    candidates = [
        os.environ.get("OSS_AGENT_CHROMIUM"),
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
        shutil.which("google-chrome"),
    ]
    return next((c for c in candidates if c and os.path.exists(c)), None)


@pytest.fixture(scope="module")
def browser():
    executable = chromium_executable()
    if executable is None:
        pytest.skip(
            "headless Chromium is not installed (run `bash .ci/browser.sh`, or point OSS_AGENT_CHROMIUM "
            "at a Chromium binary): the playground's browser tests are skipped"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]'): the playground's browser tests are skipped")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Page:
    """A fresh browser context (its own localStorage) on the page, recording what the page sent
    to /v1/responses and any script error it hit."""

    def __init__(self, browser, name: str):
        self.name = name
        self.context = browser.new_context(viewport={"width": 1100, "height": 1000})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.sent: list[dict] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("request", self._record)

    def _record(self, request) -> None:
        if request.method == "POST" and request.url.endswith("/v1/responses"):
            self.sent.append(json.loads(request.post_data))

    def open(self, server) -> "Page":
        self.page.goto(f"{server.url}/")
        self.page.wait_for_selector("body[data-ready=true]")
        return self

    def send(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def use_tools(self, tools: list[dict]) -> None:
        """Settings: the extra tools (function and MCP) sent with each request."""
        self.page.click("#settings-button")
        self.page.fill("#settings-tools", json.dumps(tools))
        self.page.click("#settings-save")

    def turn(self, n: int):
        return self.page.locator(".turn.assistant").nth(n)

    def finished(self, n: int, *expected: str) -> None:
        """Wait until assistant turn n stops streaming; it must end in an `expected` state
        (default: completed)."""
        # The turn's state settles with its last event; the page takes the next message only
        # once the request has closed too (body not busy), so wait for both.
        self.page.wait_for_function(
            "n => { const t = document.querySelectorAll('.turn.assistant')[n];"
            " return t && t.dataset.state !== 'streaming' && document.body.dataset.busy !== 'true'; }",
            arg=n,
        )
        state = self.turn(n).get_attribute("data-state")
        assert state in (expected or ("completed",)), f"turn {n} ended {state}: {self.turn(n).inner_text()}"

    def screenshot(self, label: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{self.name}-{label}.png"))


@pytest.fixture
def page(browser, request):
    view = Page(browser, request.node.name.removeprefix("test_"))
    yield view
    errors = view.errors
    view.context.close()
    # A 401 is logged by Chromium as a failed resource load; that is the key prompt's cue, not a bug.
    assert [e for e in errors if "401" not in e] == [], "the page hit script errors"


# --- serving the page (no browser needed) -------------------------------------------------


def test_page_and_assets_are_served_without_a_key_and_locked_down(tmp_path):
    app = make_app(ScriptedEngine, tmp_path / "r.db", api_key="s3cret")
    with LiveServer(app, api_key="s3cret") as server:
        page = httpx.get(f"{server.url}/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        # No inline script or handler: everything the page runs comes from its own files.
        assert not re.search(r"<script(?![^>]*\bsrc=)", page.text) and not re.search(r"\son\w+=", page.text)
        # Every asset the page and its modules refer to is served, without the key, as the right type.
        assets = set(re.findall(r'(?:src|href)="(static/[^"]+)"', page.text))
        seen = set()
        while assets - seen:
            path = sorted(assets - seen)[0]
            seen.add(path)
            r = httpx.get(f"{server.url}/{path}")
            assert r.status_code == 200, path
            kind = {"js": "javascript", "css": "text/css"}[path.rsplit(".", 1)[1]]
            assert kind in r.headers["content-type"], (path, r.headers["content-type"])
            assets |= {f"static/{name}" for name in re.findall(r'from "\./([\w.]+)"', r.text)}
        assert {
            "static/playground.js",
            "static/markdown.js",
            "static/turn.js",
            "static/api.js",
            "static/playground.css",
        } <= seen
        # The API behind it still wants the key; the static mount serves nothing outside its folder.
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        # (%2e%2e reaches the server as "/static/../x": public by prefix, so it must not escape.)
        for escape in ("/static/%2e%2e/app.py", "/static/%2e%2e/v1/models", "/static/%2e%2e/%2e%2e/pyproject.toml"):
            assert httpx.get(f"{server.url}{escape}").status_code == 404, escape
        assert httpx.get(f"{server.url}/static/nothing.js").json()["error"]["code"] == "not_found"


# --- in the browser -------------------------------------------------------------------------


def test_streams_reasoning_search_step_citations_and_continues(fake_server, page, fake_tools):
    engine = fake_server.engine
    engine.token_delay = 0.025  # slow enough that the page shows the answer before it is complete
    engine.say(SEARCH, CITED)
    page.open(fake_server)
    assert page.page.inner_text("#model-name") == MODEL
    page.page.select_option("#effort", "high")
    page.page.check("#tool-web")
    page.send("What license does gpt-oss use?")

    # The reasoning panel appears while the model reasons; opening it shows the reasoning.
    reasoning = page.turn(0).locator("details.reasoning").first
    reasoning.locator("summary").click()
    assert reasoning.get_attribute("open") is not None
    page.page.wait_for_function(
        "() => document.querySelector('.reasoning-text')?.textContent === 'I should look this up.'"
    )

    # The answer streams in: there is a moment with part of the text on the page, still streaming.
    partial = page.page.wait_for_function(
        "() => { const t = document.querySelector('.turn.assistant'); const a = t.querySelector('.answer');"
        " return t.dataset.state === 'streaming' && a && a.textContent.length > 10 && a.textContent; }"
    ).json_value()
    page.screenshot("streaming")
    page.finished(0)
    answer = page.turn(0).locator(".answer")
    assert answer.inner_text() == CITED_SHOWN
    assert CITED_SHOWN.startswith(partial) and len(partial) < len(CITED_SHOWN)

    # The search is a step with its query and results; the citation is a link to its source.
    step = page.turn(0).locator(".step[data-type=web_search_call]")
    assert step.locator(".step-title").inner_text() == "Searched “gpt-oss license”"
    step.locator("summary").click()
    assert step.locator(".sources a").evaluate_all("links => links.map(a => a.href)") == [
        "https://example.org/oss",
        "https://example.org/harmony",
    ]
    citation = answer.locator("a.citation")
    assert citation.inner_text() == "gpt-oss release notes"
    assert citation.get_attribute("href") == "https://example.org/oss"
    assert citation.get_attribute("target") == "_blank" and "noopener" in citation.get_attribute("rel")
    assert page.turn(0).locator("details.reasoning").count() == 2  # before the search, and after it
    assert re.match(
        r"completed · \d+ in · \d+ out \(\d+ reasoning\) tokens", page.turn(0).locator(".meta").inner_text()
    )
    assert fake_tools["browser"].calls == [("browser.search", '{"query": "gpt-oss license"}')]
    first = page.sent[0]
    assert first["reasoning"] == {"effort": "high"} and first["tools"] == [{"type": "web_search_preview"}]
    assert first["stream"] is True and "previous_response_id" not in first
    assert "Reasoning: high" in prompt_text(engine.calls[0])

    # The next message continues the conversation with previous_response_id.
    engine.say(final("You are welcome."))
    page.send("Thanks!")
    page.finished(1)
    assert page.sent[1]["previous_response_id"] == page.turn(0).get_attribute("data-response-id")
    assert "What license does gpt-oss use?" in prompt_text(engine.calls[-1])
    assert page.turn(1).locator(".answer").inner_text() == "You are welcome."
    page.screenshot("conversation")

    # New chat starts over: no previous response.
    page.page.click("#new-chat")
    assert page.page.locator(".turn").count() == 0 and page.page.is_visible("#empty")
    engine.say(final("Hello again."))
    page.send("Hi")
    page.finished(0)
    assert "previous_response_id" not in page.sent[2]


def test_python_mcp_and_function_steps_and_sending_a_function_output(fake_server, page, fake_tools):
    engine = fake_server.engine
    engine.say(PYTHON, MCP_CALL, WEATHER_CALL)
    page.open(fake_server)
    page.page.check("#tool-python")
    page.page.click("#settings-button")
    page.page.fill("#settings-tools", "not json")
    page.page.click("#settings-save")
    assert "JSON array" in page.page.inner_text("#settings-error")
    page.page.fill("#settings-tools", json.dumps([WEATHER_TOOL, MCP_TOOL]))
    page.page.click("#settings-save")
    assert not page.page.locator("#settings-dialog").evaluate("d => d.open")
    page.send("Compute 6*7, then get the weather in Oslo and Paris.")
    page.finished(0)

    python = page.turn(0).locator(".step[data-type=code_interpreter_call]")
    python.locator("summary").click()
    assert python.locator(".step-title").inner_text() == "Ran Python"
    assert python.locator(".step-pre.code").inner_text() == "print(6 * 7)"
    assert python.locator(".step-pre.output").inner_text().strip() == "42"
    assert fake_tools["python"].calls == ["print(6 * 7)"]

    # A tool the server runs (MCP): its arguments and result.
    listing = page.turn(0).locator(".step[data-type=mcp_list_tools] .step-title")
    assert listing.inner_text() == "Listed 1 tool on weather"
    mcp = page.turn(0).locator(".step[data-type=mcp_call]")
    mcp.locator("summary").click()
    assert mcp.locator(".step-title").inner_text() == "weather.get_forecast(…)"
    assert json.loads(mcp.locator(".step-pre.code").inner_text()) == {"city": "Oslo"}
    assert mcp.locator(".step-pre.output").inner_text() == "Sunny in Oslo, 21°C."

    # The response ends in a function call: the step shows its arguments and asks for its output.
    function = page.turn(0).locator(".step[data-type=function_call]")
    assert function.get_attribute("data-state") == "waiting"
    assert function.locator(".step-title").inner_text() == "get_weather(…)"
    assert json.loads(function.locator(".step-pre.code").inner_text()) == {"city": "Paris"}
    page.screenshot("function-call")
    engine.say(final("It is 21 °C in Paris."))
    function.locator("textarea.function-output").fill("21 °C and sunny")
    page.turn(0).locator(".function-bar button").click()
    page.finished(1)
    assert function.locator(".step-pre.output").inner_text() == "21 °C and sunny"
    first_id = page.turn(0).get_attribute("data-response-id")
    call_id = fake_server.client().responses.retrieve(first_id).output[-1].call_id
    sent = page.sent[-1]
    assert sent["input"] == [{"type": "function_call_output", "call_id": call_id, "output": "21 °C and sunny"}]
    assert sent["previous_response_id"] == first_id
    assert prompt_text(engine.calls[-1]).endswith(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>21 °C and sunny<|end|>"
        "<|start|>assistant"
    )
    assert page.turn(1).locator(".answer").inner_text() == "It is 21 °C in Paris."


def ask_for_the_weather(fake_server, page) -> ScriptedEngine:
    """A chat whose first turn ends in a get_weather call, left waiting for its output."""
    engine = fake_server.engine
    engine.say(WEATHER_CALL)
    page.open(fake_server)
    page.use_tools([WEATHER_TOOL])
    page.send("Weather in Paris?")
    page.finished(0)
    return engine


def test_a_message_typed_instead_of_a_function_output_goes_on(fake_server, page):
    # The server continues a response that ended in calls only with their outputs: a typed
    # message goes with them (a note for an empty box), so the chat does not wedge on 400s.
    engine = ask_for_the_weather(fake_server, page)
    engine.say(final("Hello!"), final("Hello again!"))
    page.send("Never mind, just say hello.")
    page.finished(1)
    page.send("Hello?")
    page.finished(2)
    first = fake_server.client().responses.retrieve(page.turn(0).get_attribute("data-response-id"))
    assert page.sent[1]["input"] == [
        {
            "type": "function_call_output",
            "call_id": first.output[-1].call_id,
            "output": "(no output: the user wrote a message instead)",
        },
        {"role": "user", "content": "Never mind, just say hello."},
    ]
    assert page.sent[2]["input"] == "Hello?"
    assert page.turn(2).locator(".answer").inner_text() == "Hello again!"


def test_outputs_that_did_not_get_through_go_with_the_next_message(fake_server, page):
    engine = ask_for_the_weather(fake_server, page)
    page.turn(0).locator("textarea.function-output").fill("21 °C")
    page.page.route("**/v1/responses", lambda route: route.abort())  # the outputs' request fails
    page.turn(0).locator(".function-bar button").click()
    page.finished(1, "failed")
    page.page.unroute("**/v1/responses")
    page.errors.clear()  # (Chromium logs the aborted request)
    engine.say(final("It is 21 °C."))
    page.send("So?")
    page.finished(2)
    call_id = fake_server.client().responses.retrieve(page.turn(0).get_attribute("data-response-id")).output[-1].call_id
    assert page.sent[-1]["input"] == [
        {"type": "function_call_output", "call_id": call_id, "output": "21 °C"},
        {"role": "user", "content": "So?"},
    ]
    assert page.turn(2).locator(".answer").inner_text() == "It is 21 °C."


def test_the_pages_own_citation_marks_in_the_text_stay_text(fake_server, page):
    fake_server.engine.say(final("Plain text with \ue0007\ue001 inside, and more after it."))
    page.open(fake_server)
    page.send("Say something.")
    page.finished(0)
    answer = page.turn(0).locator(".answer").inner_text()
    assert "more after it" in answer and "\ue000" not in answer


def test_stop_ends_the_generation_and_the_chat_goes_on(fake_server, page):
    engine = fake_server.engine
    engine.say(final("Ready."))
    page.open(fake_server)
    page.send("Are you there?")
    page.finished(0)

    engine.token_delay = 0.02
    engine.say(final(" word" * 400))
    page.send("Write a long essay.")
    page.page.wait_for_function("() => document.querySelectorAll('.answer')[1]?.textContent.length > 20")
    assert page.page.is_visible("#stop") and not page.page.is_visible("#send")
    page.page.click("#stop")
    page.finished(1, "stopped")
    assert page.page.is_visible("#send") and not page.page.is_visible("#stop")
    # The server noticed the client going away and stopped generating.
    wait_for(lambda: engine.running == 0)
    assert engine.calls[-1].finish_reason == "abort" and len(engine.calls[-1].generated) < 400
    shown = page.turn(1).locator(".answer").inner_text()
    assert 0 < shown.count("word") < 400
    assert "stopped" in page.turn(1).locator(".meta").inner_text()
    page.screenshot("stopped")

    # The next message continues from the last finished answer (a cancelled one cannot be).
    engine.token_delay = 0.0
    engine.say(final("Still here."))
    page.send("Shorter, please.")
    page.finished(2)
    assert page.sent[2]["previous_response_id"] == page.turn(0).get_attribute("data-response-id")
    assert page.turn(2).locator(".answer").inner_text() == "Still here."


MARKDOWN = (
    "# Title\n\nSome **bold**, *italic* and `inline <b>code</b>` text.\n\n"
    '<script>window.__pwned = 1</script>\n<img src=x onerror="window.__pwned = 2">\n\n'
    "[bad link](javascript:window.__pwned=3) and [good link](https://example.org/page) and https://example.org/bare\n\n"
    "- one\n- two\n  1. nested\n\n"
    "| a | b |\n|---|:-:|\n| <i>x</i> | 2 |\n\n"
    '```html\n<iframe src="javascript:window.__pwned=4"></iframe>\n```\n\n> quoted'
)


def test_markdown_is_rendered_and_model_html_stays_text(fake_server, page):
    fake_server.engine.say(final(MARKDOWN, reasoning='<img src=y onerror="window.__pwned = 5"> thinking'))
    page.open(fake_server)
    page.send("Show me some markdown.")
    page.finished(0)
    answer = page.turn(0).locator(".answer")
    assert answer.locator("h1").inner_text() == "Title"
    assert answer.locator("strong").inner_text() == "bold" and answer.locator("em").inner_text() == "italic"
    assert answer.locator("p code").first.inner_text() == "inline <b>code</b>"
    assert answer.locator("ul > li").count() == 2 and answer.locator("ul ol > li").inner_text() == "nested"
    assert answer.locator("table td").all_inner_texts() == ["<i>x</i>", "2"]
    assert answer.locator("pre code").inner_text() == '<iframe src="javascript:window.__pwned=4"></iframe>'
    assert answer.locator("blockquote").inner_text() == "quoted"
    # Model-written HTML is shown as text, never turned into elements; unsafe links lose their target.
    text = answer.inner_text()
    assert "<script>window.__pwned = 1</script>" in text and '<img src=x onerror="window.__pwned = 2">' in text
    for tag in ("script", "img", "iframe", "b", "i"):
        assert answer.locator(tag).count() == 0, tag
    assert answer.locator("a").evaluate_all("links => links.map(a => a.href)") == [
        "https://example.org/page",
        "https://example.org/bare",
    ]
    assert "bad link" in text
    reasoning = page.turn(0).locator(".reasoning-text")
    assert reasoning.evaluate("r => r.textContent") == '<img src=y onerror="window.__pwned = 5"> thinking'
    assert reasoning.locator("img").count() == 0
    assert page.page.evaluate("window.__pwned") is None
    page.screenshot("markdown")


def test_api_key_is_asked_for_once_and_kept(tmp_path, page):
    engine = ScriptedEngine()
    app = make_app(lambda: engine, tmp_path / "r.db", api_key="s3cret")
    with LiveServer(app, api_key="s3cret") as server:
        page.open(server)  # the page itself needs no key; its first API call gets a 401
        dialog = page.page.locator("#key-dialog")
        page.page.wait_for_function("() => document.getElementById('key-dialog').open")
        assert "API key" in page.page.inner_text("#key-message")
        page.page.fill("#key-input", "wrong")
        page.page.click("#key-save")
        page.page.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused')")
        assert dialog.evaluate("d => d.open")
        page.screenshot("key-prompt")
        page.page.fill("#key-input", "s3cret")
        page.page.click("#key-save")
        page.page.wait_for_function(f"() => document.getElementById('model-name').textContent === {MODEL!r}")
        engine.say(final("Authenticated."))
        page.send("Hello")
        page.finished(0)
        assert page.turn(0).locator(".answer").inner_text() == "Authenticated."
        # A reload remembers the key: no prompt, the API answers.
        page.page.reload()
        page.page.wait_for_function(f"() => document.getElementById('model-name').textContent === {MODEL!r}")
        assert not dialog.evaluate("d => d.open")
        assert page.page.evaluate("localStorage.getItem('oss-agent.api-key')") == "s3cret"


def test_smoke_on_the_tiny_real_engine(tiny_engine_server, page):
    page.open(tiny_engine_server)
    page.page.click("#settings-button")
    page.page.fill("#settings-max-tokens", "12")
    page.page.click("#settings-save")
    page.send("Hello, tiny model.")
    page.finished(0, "completed", "incomplete")  # random weights: it rarely stops on its own
    assert page.sent[0]["max_output_tokens"] == 12
    meta = page.turn(0).locator(".meta").inner_text()
    out_tokens = int(re.search(r"(\d+) out", meta).group(1))
    assert 0 < out_tokens <= 12 and page.turn(0).locator(".error-box").count() == 0
    page.screenshot("tiny-engine")


def test_code_in_a_numbered_list_keeps_its_indentation(fake_server, page):
    # A fenced block under "1. " is indented by the item's content (3 columns): the code shown
    # (and copied) must not keep a stray leading space, which breaks pasted Python.
    code = "def f():\n    return 1"
    indented = "\n".join(f"   {line}" for line in code.split("\n"))
    fake_server.engine.say(
        final(
            f"1. Define it:\n   ```python\n{indented}\n   ```\n2. Call it.\n\n"
            f"10. Later:\n    ```python\n    x = 1\n    ```"
        )
    )
    page.open(fake_server)
    page.send("Show me a function.")
    page.finished(0)
    blocks = page.turn(0).locator(".answer pre code")
    assert blocks.nth(0).evaluate("c => c.textContent") == code
    assert blocks.nth(1).evaluate("c => c.textContent") == "x = 1"
    assert page.turn(0).locator(".answer ol > li").count() == 3


def test_copy_works_when_the_page_is_served_over_plain_http(tmp_path, fake_engine, fake_tools, browser):
    # A GPU box on the LAN is reached as http://host:port/: not a secure context, so
    # navigator.clipboard is undefined there. The code block's Copy button must still copy.
    # (The server answers for that name as `serve --allowed-host gpu-box.test` does.)
    app = make_app(lambda: fake_engine, tmp_path / "r.db", tools=fake_tools.values(), allowed_hosts=["gpu-box.test"])
    server = LiveServer(app).start()
    fake_engine.say(final("```bash\necho hi\n```"))
    port = server.url.rsplit(":", 1)[1]
    lan = browser.browser_type.launch(
        executable_path=chromium_executable(), args=CHROMIUM_ARGS + ["--host-resolver-rules=MAP gpu-box.test 127.0.0.1"]
    )
    try:
        view = lan.new_page()
        view.set_default_timeout(TIMEOUT_MS)
        view.goto(f"http://gpu-box.test:{port}/")
        view.wait_for_selector("body[data-ready=true]")
        assert view.evaluate("isSecureContext") is False
        view.evaluate(
            "() => document.addEventListener('copy', e => {"
            " window.__copied = e.target.value ?? String(getSelection()); })"
        )
        view.fill("#input", "A command?")
        view.press("#input", "Enter")
        view.wait_for_function("() => document.querySelector('.turn.assistant')?.dataset.state === 'completed'")
        view.click(".code-copy")
        wait_for(lambda: view.inner_text(".code-copy") != "Copy", timeout=5)
        assert view.inner_text(".code-copy") == "Copied"
        assert view.evaluate("window.__copied") == "echo hi"
    finally:
        lan.close()
        server.stop()


def test_escape_that_closes_a_dialog_does_not_stop_the_generation(fake_server, page):
    engine = fake_server.engine
    engine.token_delay = 0.01
    engine.say(final(" word" * 150))
    page.open(fake_server)
    page.send("Write a long essay.")
    page.page.wait_for_function("() => document.querySelector('.answer')?.textContent.length > 20")
    page.page.click("#settings-button")
    page.page.keyboard.press("Escape")  # closes Settings; it is not a Stop
    assert not page.page.locator("#settings-dialog").evaluate("d => d.open")
    page.finished(0)
    assert page.turn(0).locator(".answer").inner_text().count("word") == 150
    # With no dialog open, Esc still stops.
    engine.say(final(" word" * 400))
    page.send("Again.")
    page.page.wait_for_function("() => document.querySelectorAll('.answer')[1]?.textContent.length > 20")
    page.page.keyboard.press("Escape")
    page.finished(1, "stopped")


def test_a_finished_mcp_tool_listing_is_not_shown_as_stopped(fake_server, page):
    # An mcp_list_tools item has no status field: its output_item.done is what says it finished.
    fake_server.engine.say(final("Ready."))
    page.open(fake_server)
    page.use_tools([MCP_TOOL])
    page.send("What can you do?")
    page.finished(0)
    listing = page.turn(0).locator(".step[data-type=mcp_list_tools]")
    assert listing.locator(".step-title").inner_text() == "Listed 1 tool on weather"
    assert listing.get_attribute("data-state") == "done"
    assert listing.locator(".step-status").inner_text() == ""


def test_markdown_edge_cases_render_as_written(fake_server, page):
    # "*args and **kwargs": the ** before kwargs follows a space, so it cannot close the *.
    # Only a run of #s after a space closes an ATX heading: "C#" is a word. Wikipedia's URLs end
    # in "(...)": only an unmatched ")" (or final punctuation) is not the URL's.
    fake_server.engine.say(
        final(
            "Call f(*args, **kwargs). Pass *args and **kwargs through. Keep *this* and **that** styled.\n\n"
            "## Why C#\n\ntext\n\n### F# ###\n\n# Closed #\n\n"
            "See https://en.wikipedia.org/wiki/Python_(programming_language). (Also: https://example.org/a.)"
        )
    )
    page.open(fake_server)
    page.send("Show me some Markdown.")
    page.finished(0)
    answer = page.turn(0).locator(".answer")
    first = answer.locator("p").first
    assert first.inner_text() == "Call f(*args, **kwargs). Pass *args and **kwargs through. Keep this and that styled."
    assert first.locator("em").all_inner_texts() == ["this"]
    assert first.locator("strong").all_inner_texts() == ["that"]
    assert answer.locator("h2").inner_text() == "Why C#"
    assert answer.locator("h3").inner_text() == "F#"
    assert answer.locator("h1").inner_text() == "Closed"
    links = answer.locator("a")
    assert links.evaluate_all("links => links.map(a => [a.href, a.textContent])") == [
        [
            "https://en.wikipedia.org/wiki/Python_(programming_language)",
            "https://en.wikipedia.org/wiki/Python_(programming_language)",
        ],
        ["https://example.org/a", "https://example.org/a"],
    ]
    assert answer.inner_text().endswith("_language). (Also: https://example.org/a.)")


def test_an_answer_that_finished_is_not_stopped_while_the_server_tidies_up(fake_server, page, monkeypatch):
    # After response.completed the server still closes the turn's tool sessions and stores it
    # before the stream ends. The answer is complete: the page takes the next message at once,
    # and an Esc / Stop then must not mark it stopped and drop it from the conversation.
    import asyncio

    from tests import fake_tools

    async def slow_close(self):
        await asyncio.sleep(4)

    monkeypatch.setattr(fake_tools.FakePythonSession, "close", slow_close)
    engine = fake_server.engine
    engine.say(PYTHON, final("It is 42."))
    page.open(fake_server)
    page.page.check("#tool-python")
    page.send("What is 6*7?")
    page.page.wait_for_function("() => document.querySelector('.turn.assistant')?.dataset.state === 'completed'")
    page.page.keyboard.press("Escape")
    page.finished(0)
    engine.say(final("Nothing more."))
    page.send("Anything else?")
    page.finished(1)
    assert page.sent[1]["previous_response_id"] == page.turn(0).get_attribute("data-response-id")


def test_the_dialogs_are_named_for_assistive_technology(fake_server, page):
    page.open(fake_server)
    page.page.click("#settings-button")
    assert page.page.get_by_role("dialog", name="Settings").is_visible()
    page.page.keyboard.press("Escape")
    assert page.page.locator("#key-dialog").get_attribute("aria-labelledby") == "key-title"
    assert page.page.inner_text("#key-title") == "API key"


def test_the_header_takes_two_rows_on_a_phone(fake_server, browser):
    # At 390 px it wrapped to three rows.
    context = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        page = context.new_page()
        page.goto(f"{fake_server.url}/")
        page.wait_for_selector("body[data-ready=true]")
        boxes = page.evaluate(
            "[document.querySelector('.brand'), ...document.querySelector('.controls').children]"
            ".map(e => e.getBoundingClientRect()).map(r => [Math.round(r.top), r.right])"
        )
        tops = [top for top, _ in boxes[1:]]
        assert max(tops) - min(tops) < 10 and min(tops) > boxes[0][0]  # the controls: one row, under the brand
        assert max(right for _, right in boxes) <= 390
        # The shortened labels keep their full names for screen readers.
        assert page.get_by_role("checkbox", name="Web search").is_visible()
        assert page.get_by_role("button", name="New chat").is_visible()
        assert page.get_by_role("combobox", name="Reasoning").is_visible()
    finally:
        context.close()


def test_reasoning_time_counts_from_when_the_model_began(fake_server, page):
    # "Reasoned for 0.0 s": the clock started when the reasoning item appeared, after the
    # prompt's prefill and the item's header, so a short reasoning read as no time at all.
    engine = fake_server.engine
    engine.token_delay = 0.1
    engine.say(final("Done.", reasoning="Hm."))
    page.open(fake_server)
    page.send("Think briefly.")
    page.finished(0)
    label = page.turn(0).locator(".reasoning-label").inner_text()
    value, unit = re.fullmatch(r"Reasoned for (\d+(?:\.\d)?) (s|ms)", label).groups()
    seconds = float(value) / (1000 if unit == "ms" else 1)
    # Every token up to its <|end|> came 0.1 s apart, its header (<|channel|>analysis<|message|>)
    # included: the old clock missed those three.
    from tests.fake_engine import harmony_tokens

    tokens = len(harmony_tokens("<|channel|>analysis<|message|>Hm.<|end|>"))
    assert seconds >= 0.9 * tokens * engine.token_delay, label


def test_the_default_servers_first_answer_is_quick_and_says_what_the_model_is(default_server, page):
    # On the random-weight default model the first answer took 127 s and ended "incomplete
    # (max_output_tokens)" though no limit was set, and nothing said the text is noise.
    page.open(default_server)
    notice = page.page.locator("#notice")
    assert notice.is_visible()
    text = notice.inner_text()
    assert "random weights" in text and "noise" in text and "--model" in text and "after 48 tokens" in text
    page.send("Hello!")
    page.finished(0, "completed", "incomplete")
    meta = page.turn(0).locator(".meta").inner_text()
    assert "incomplete (max_output_tokens)" not in meta
    if page.turn(0).get_attribute("data-state") == "incomplete":
        assert "stopped at 48 tokens, the server's default limit" in meta
    assert float(re.search(r"([\d.]+) s$", meta).group(1)) < 60
    # Its tokens may never form a message (a header that does not end): the turn says so.
    assert page.turn(0).locator(".items").inner_text().strip()
    assert "max_output_tokens" not in page.sent[0]
    page.screenshot("default-server")


def test_a_forced_web_search_runs_on_the_default_model(default_server, page):
    # The random-weight default model calls no tool of its own accord: the Tools control makes
    # the search its first step (tool_choice), and the page shows the search step it ran.
    page.open(default_server)
    assert "pick one under Tools" in page.page.inner_text("#notice")
    page.page.select_option("#tool-choice", "web_search_preview")
    assert page.page.is_checked("#tool-web")  # forcing the search switched it on
    page.send("What is gpt-oss?")
    page.finished(0, "completed", "incomplete")  # (the answer after the search runs to the limit)
    sent = page.sent[0]
    assert sent["tool_choice"] == {"type": "web_search_preview"} and {"type": "web_search_preview"} in sent["tools"]
    step = page.turn(0).locator(".step[data-type=web_search_call]").first
    assert step.get_attribute("data-state") == "done"
    assert step.locator(".step-title").inner_text().startswith("Searched “")
    step.locator("summary").click()
    assert step.locator(".step-label").first.text_content() == "Query"
    # The query shown is the one the server's browser searched for.
    stored = httpx.get(f"{default_server.url}/v1/responses/{page.turn(0).get_attribute('data-response-id')}").json()
    search = next(o for o in stored["output"] if o["type"] == "web_search_call")
    assert (
        search["status"] == "completed" and step.locator(".step-pre").first.text_content() == search["action"]["query"]
    )
    page.screenshot("forced-search")


def test_the_tool_choice_control(fake_server, page):
    engine = fake_server.engine
    engine.say(PYTHON, final("It is 832040."), final("Hi."), final("Hi again."))
    page.open(fake_server)
    assert page.page.input_value("#tool-choice") == "auto"
    # A suggestion that uses a tool forces it.
    page.page.click("[data-suggestion^='Use Python']")
    assert page.page.input_value("#tool-choice") == "code_interpreter" and page.page.is_checked("#tool-python")
    page.page.press("#input", "Enter")
    page.finished(0)
    assert page.sent[0]["tool_choice"] == {"type": "code_interpreter"}
    assert {"type": "code_interpreter", "container": {"type": "auto"}} in page.sent[0]["tools"]
    assert page.turn(0).locator(".step[data-type=code_interpreter_call]").count() == 1
    # Switching the forced tool off leaves the choice to the model again ("auto" is not sent).
    page.page.uncheck("#tool-python")
    assert page.page.input_value("#tool-choice") == "auto"
    page.send("Hello.")
    page.finished(1)
    assert "tool_choice" not in page.sent[1]
    # "required": any tool, and the choice is remembered across a reload.
    page.page.check("#tool-web")
    page.page.select_option("#tool-choice", "required")
    page.page.reload()
    page.page.wait_for_selector("body[data-ready=true]")
    assert page.page.input_value("#tool-choice") == "required"
    page.send("Hello again.")
    page.page.wait_for_function("() => document.querySelectorAll('.turn.assistant')[0]?.dataset.state === 'completed'")
    assert page.sent[-1]["tool_choice"] == "required" and page.sent[-1]["tools"] == [{"type": "web_search_preview"}]
