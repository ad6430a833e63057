"""The real tool servers behind the live server, driven through `/v1/responses` by the `openai` SDK.

tests/agent_server/responses/test_routes.py checks the agent loop against fake tool servers; here the tools
are the ones `oss-agent serve --tool-server ...` starts (`tools.servers.start_tool_servers`):
a real MCP server (the `mcp` package over streamable HTTP on loopback), the real browser on a
folder of documents, and the real Python sandbox. The model is scripted (`ScriptedEngine`) or,
for the MCP and browser paths, the real engine on the tiny checkpoint teacher-forced through the
same script, so what the client receives is what a deployment would serve.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from openai.types.responses import (
    ResponseMcpCallArgumentsDeltaEvent,
    ResponseMcpCallArgumentsDoneEvent,
    ResponseMcpCallCompletedEvent,
    ResponseMcpCallFailedEvent,
    ResponseMcpCallInProgressEvent,
    ResponseMcpListToolsCompletedEvent,
    ResponseMcpListToolsInProgressEvent,
    ResponseStreamEvent,
)
from pydantic import TypeAdapter

from inference.tokenizer import harmony_encoding
from tests.agent_server.responses.test_routes import check_stream_invariants, stream_events
from tests.conftest import MODEL, LiveServer
from tests.fake_engine import ScriptedEngine, TeacherForcedEngine, harmony_tokens
from tests.sandbox_host import host_command
from tests.tools.python.test_sandbox import Listeners, require
from tests.tools.test_mcp_client import make_server

REPO = Path(__file__).resolve().parents[3]
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(params=["fake", "tiny"])
def engine(request):
    """The scripted model, or the real engine on the tiny checkpoint forced to say the script
    (with room for the browser's pages: the tiny model has 4096 positions)."""
    if request.param == "fake":
        return ScriptedEngine()
    from inference.engine.async_engine import AsyncEngine

    checkpoint = request.getfixturevalue("tiny_checkpoint")
    return TeacherForcedEngine(
        AsyncEngine.from_pretrained(
            str(checkpoint), device="cpu", max_model_len=2048, num_pages=256, enforce_eager=True
        )
    )


def serve_app(engine, tmp_path: Path, tool_server_specs: list[str], **tool_options) -> LiveServer:
    """The app as `oss-agent serve --tool-server SPEC...` builds it, on `engine`."""
    from agent_server.app import create_app
    from agent_server.state import ServerConfig
    from tools.servers import start_tool_servers

    async def tool_servers():
        return await start_tool_servers(tool_server_specs, **tool_options)

    config = ServerConfig(model_name=MODEL, store_path=tmp_path / "responses.sqlite3")
    return LiveServer(create_app(config, lambda: engine, tool_servers=tool_servers), kind="real-tools")


def prompt_text(call) -> str:
    return harmony_encoding().decode(call.request.prompt_token_ids)


def check_sdk_types(events) -> None:
    """Every event the SDK's stream produced is the SDK's own event class for its type (or the
    stream's subclass of it), and validates strictly: the stream builds events unvalidated."""
    for event in events:
        strict = STREAM_EVENT.validate_python(event.to_dict(warnings=False))
        assert isinstance(event, type(strict)), (event.type, type(event))


# --- MCP ------------------------------------------------------------------------------------


@contextmanager
def mcp_server_on_loopback():
    """The `mcp` package's server over streamable HTTP on 127.0.0.1; yields its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_server().streamable_http_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the MCP server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = server.force_exit = True
        thread.join(10)
        sock.close()


def test_mcp_server_listed_and_called_through_responses(engine, tmp_path):
    label = "Unit_Conversions"  # the MCP server's own name, as a Harmony namespace
    engine.say(
        f"<|channel|>commentary to={label}.celsius_to_fahrenheit <|constrain|>json<|message|>"
        '{"celsius": 37.5}<|call|>',
        f'<|channel|>commentary to={label}.fail <|constrain|>json<|message|>{{"reason": "on purpose"}}<|call|>',
        "<|channel|>final<|message|>37.5 °C is 99.5 °F.<|return|>",
    )
    with mcp_server_on_loopback() as port, serve_app(engine, tmp_path, [f"127.0.0.1:{port}"], mcp_timeout=5) as server:
        client = server.client()
        events, final = stream_events(
            client,
            model=MODEL,
            input="What is 37.5 C in F?",
            tools=[{"type": "mcp", "server_label": label, "require_approval": "never"}],
        )
        health = httpx.get(f"{server.url}/health")
    check_stream_invariants(events, final)
    check_sdk_types(events)

    listing, converted, failed, message = final.output
    assert listing.type == "mcp_list_tools" and listing.server_label == label and listing.error is None
    tools = {tool.name: tool for tool in listing.tools}
    assert set(tools) == {"celsius_to_fahrenheit", "describe", "fail", "wait"}
    assert tools["celsius_to_fahrenheit"].description == "Convert a temperature from Celsius to Fahrenheit."
    assert tools["describe"].input_schema["required"] == ["items"]

    # The real server computed the answer; its failure came back as a failed call.
    assert converted.type == "mcp_call" and converted.status == "completed"
    assert (converted.server_label, converted.name) == (label, "celsius_to_fahrenheit")
    assert json.loads(converted.arguments) == {"celsius": 37.5}
    assert converted.output == "99.5" and converted.error is None
    assert failed.type == "mcp_call" and failed.status == "failed" and failed.output is None
    assert failed.error.type == "mcp_tool_execution_error"
    assert failed.error.content == "Error executing tool fail"  # what the mcp server says of an exception
    assert message.type == "message" and message.content[0].text == "37.5 °C is 99.5 °F."
    assert health.status_code == 200

    # The MCP events, each the SDK's own class, in order for each item.
    def of(index):
        return [
            type(e) for e in events if getattr(e, "output_index", None) == index and e.type.startswith("response.mcp")
        ]

    assert of(0) == [ResponseMcpListToolsInProgressEvent, ResponseMcpListToolsCompletedEvent]
    for index, end in ((1, ResponseMcpCallCompletedEvent), (2, ResponseMcpCallFailedEvent)):
        # The arguments stream as the model writes them; then the call runs.
        kinds = of(index)
        assert kinds[-3:] == [ResponseMcpCallArgumentsDoneEvent, ResponseMcpCallInProgressEvent, end]
        assert set(kinds[:-3]) == {ResponseMcpCallArgumentsDeltaEvent}
        deltas = "".join(
            e.delta for e in events if isinstance(e, ResponseMcpCallArgumentsDeltaEvent) and e.output_index == index
        )
        done = next(e for e in events if isinstance(e, ResponseMcpCallArgumentsDoneEvent) and e.output_index == index)
        assert deltas == done.arguments == final.output[index].arguments

    # The model saw the server's tools in its system message and each tool's answer.
    first, second, third = engine.calls
    assert f"namespace {label} {{" in prompt_text(first)
    assert "type celsius_to_fahrenheit = (_: {\ncelsius: number,\n}) => any;" in prompt_text(first)
    assert prompt_text(second).endswith(
        f"<|start|>{label}.celsius_to_fahrenheit to=assistant<|channel|>commentary"
        "<|message|>99.5<|end|><|start|>assistant"
    )
    assert (
        f"<|start|>{label}.fail to=assistant<|channel|>commentary<|message|>{failed.error.content}<|end|>"
        in prompt_text(third)
    )


# --- browser and citations ---------------------------------------------------------------

DOCUMENTS = {
    "solar-sails.md": "# Solar sails\n\nA solar sail is pushed by the pressure of sunlight on a large, thin mirror.\n"
    "JAXA's IKAROS unfurled the first interplanetary solar sail in 2010.\n\n"
    "See also [tides](tides.html).\n",
    "tides.html": "<html><head><title>Why the sea has tides</title></head><body>\n<h1>Tides</h1>\n"
    "<p>Ocean tides are raised mostly by the Moon's gravity, with a smaller part from the Sun.</p>\n"
    "<p>Spring tides come when the Sun and the Moon line up.</p>\n</body></html>\n",
    "kettles.txt": "Descaling kettles\n\nVinegar dissolves the limescale that hard water leaves in kettles.\n",
}


def browser_turn(function: str, arguments: dict) -> str:
    return f"<|channel|>analysis to=browser.{function} <|constrain|>json<|message|>{json.dumps(arguments)}<|call|>"


@pytest.fixture
def docs_folder():
    """DOCUMENTS in a folder whose path always has the same length: URLs are part of the pages
    the browser wraps into numbered lines, and the script cites fixed line numbers."""
    with tempfile.TemporaryDirectory(prefix="oss-agent-docs-", dir="/tmp") as folder:
        for name, text in DOCUMENTS.items():
            (Path(folder) / name).write_text(text)
        yield Path(folder)


def test_real_browser_citations_through_responses(engine, tmp_path, docs_folder):
    folder = docs_folder
    sails, tides = (folder / "solar-sails.md").as_uri(), (folder / "tides.html").as_uri()
    # Page stack: [0] search "IKAROS", [1] the sails page, [2] search "Moon tides" (tides first,
    # sails second, on lines 7-9), [3] the tides page, [4] find "spring" in it.
    engine.say(
        browser_turn("search", {"query": "IKAROS solar sail"}),
        browser_turn("open", {"id": 0}),
        browser_turn("search", {"query": "Moon tides"}),
        browser_turn("open", {"id": 0}),
        browser_turn("find", {"pattern": "spring"}),
        "<|channel|>final<|message|>A solar sail is pushed by sunlight【1†L4-L5】. The Moon raises most tides"
        "【3†L4-L5】, and IKAROS has its own page【2†L7-L8】【3†L7】. Spring tides need the Sun too【4†L1】【9†L2】."
        "<|return|>",
    )
    with serve_app(engine, tmp_path, ["browser"], search_dir=folder) as server:
        events, final = stream_events(
            server.client(),
            model=MODEL,
            input="Tell me about sails and tides.",
            tools=[{"type": "web_search_preview"}],
            include=["web_search_call.action.sources"],
        )
    check_stream_invariants(events, final)
    check_sdk_types(events)

    assert [item.type for item in final.output] == ["web_search_call"] * 5 + ["message"]
    actions = [item.action for item in final.output[:5]]
    assert [a.type for a in actions] == ["search", "open_page", "search", "open_page", "find_in_page"]
    assert [s.url for s in actions[2].sources] == [tides, sails]
    assert (actions[1].url, actions[3].url, actions[4].url) == (sails, tides, tides)
    assert actions[4].pattern == "spring"

    sails_link, tides_link = f"([Solar sails]({sails}))", f"([Why the sea has tides]({tides}))"
    text = final.output[-1].content[0]
    # Citations of: the sails page, the tides page, the second result of a search page (lines
    # 7-8), the tides page, and a find page (its page's URL); [9] does not exist and is dropped.
    assert text.text == (
        f"A solar sail is pushed by sunlight {sails_link}. The Moon raises most tides {tides_link}, "
        f"and IKAROS has its own page {sails_link} {tides_link}. "
        f"Spring tides need the Sun too {tides_link}."
    )
    # Each annotation spans exactly its link in the final text and names the cited page.
    spans = [(text.text[a.start_index : a.end_index], a.url, a.title) for a in text.annotations]
    sails_span, tides_span = (sails_link, sails, "Solar sails"), (tides_link, tides, "Why the sea has tides")
    assert spans == [sails_span, tides_span, sails_span, tides_span, tides_span]
    added = [e for e in events if e.type == "response.output_text.annotation.added"]
    assert [e.annotation_index for e in added] == [0, 1, 2, 3, 4]
    as_json = lambda a: a if isinstance(a, dict) else a.model_dump(mode="json")  # noqa: E731
    assert [as_json(e.annotation) for e in added] == [as_json(a) for a in text.annotations]

    # The model read the real pages.
    assert "<|start|>browser.search to=assistant<|channel|>commentary<|message|>[0] IKAROS solar sail\n" in prompt_text(
        engine.calls[1]
    )
    assert "\nL4:   * 【0†Solar sails】" in prompt_text(engine.calls[1])
    assert f"[1] Solar sails ({sails})\n" in prompt_text(engine.calls[2])
    assert "namespace browser {" in prompt_text(engine.calls[0])


# --- the Python sandbox, behind a server process that holds a secret --------------------------

TOOL_ANSWER = re.compile(
    r"<\|start\|>python to=assistant<\|channel\|>commentary<\|message\|>(.*)<\|end\|>"
    r"<\|start\|>assistant$",
    re.S,
)
USER_MESSAGE = re.compile(r"<\|start\|>user<\|message\|>(.*?)<\|end\|>", re.S)


class NotebookModel(ScriptedEngine):
    """A scripted model for any number of requests: it runs the user's message as a python
    cell, then answers with exactly the tool message it got back (as JSON)."""

    def _next_turn(self, request):
        prompt = harmony_encoding().decode(request.prompt_token_ids)
        answer = TOOL_ANSWER.search(prompt)
        if answer is not None:
            return harmony_tokens(f"<|channel|>final<|message|>{json.dumps(answer.group(1))}<|return|>")
        code = USER_MESSAGE.findall(prompt)[-1]
        return harmony_tokens(f"<|channel|>analysis to=python code<|message|>{code}<|call|>")


def serve_python_tool(store: str, use_namespaces: str) -> None:
    """Run in a child process (the test's stand-in for `oss-agent serve --tool-server python`):
    serve until stdin closes, after printing the URL and the sandbox's isolation report."""
    import dataclasses

    from agent_server.app import create_app
    from agent_server.state import ServerConfig
    from tools.python.sandbox import SandboxLimits
    from tools.python.server import PythonToolServer

    started = []

    async def tool_servers():
        limits = SandboxLimits(wall_seconds=2.0, interrupt_grace_seconds=1.0, cpu_seconds=30)
        started.append(await PythonToolServer.start(limits, use_namespaces=use_namespaces == "1"))
        return started

    app = create_app(ServerConfig(model_name=MODEL, store_path=Path(store)), NotebookModel, tool_servers=tool_servers)
    server = LiveServer(app).start(ready_timeout=60)
    try:
        print(json.dumps({"url": server.url, "report": dataclasses.asdict(started[0].report)}), flush=True)
        sys.stdin.read()
    finally:
        server.stop()


@contextmanager
def python_tool_server_process(tmp_path: Path, env: dict, use_namespaces: bool):
    """`serve_python_tool` in a child process with environment `env`; yields the process, the
    URL and the isolation report. Its log goes to a file (a pipe nobody reads could fill up)."""
    log = tmp_path / "server.log"
    with open(log, "w") as log_file:
        # (without namespaces, on a host where other uids can read Python: see tests.sandbox_host)
        command = [
            "-c",
            "import sys; from tests.agent_server.agent.test_loop import serve_python_tool; "
            "serve_python_tool(*sys.argv[1:])",
            str(tmp_path / "responses.sqlite3"),
            "1" if use_namespaces else "0",
        ]
        process = subprocess.Popen(
            host_command(command) if not use_namespaces else [sys.executable, *command],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    try:
        hello = process.stdout.readline()
        assert hello, f"the server process did not start:\n{log.read_text()}"
        yield process, json.loads(hello)
    finally:
        process.stdin.close()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
    assert process.returncode == 0, log.read_text()


SECRET_NAME = "OPENAI_API_KEY"
ESCAPE_NAME = "escape-through-server.txt"

HOSTILE_CELLS = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "10 GB allocation": "block = bytearray(10 * 1024**3)\nprint('ALLOCATED')",
    "server environment": """
import os
found = [key for key, value in os.environ.items() if key == {name!r} or value == {secret!r}]
for path in ["/proc/{server_pid}/environ", "/proc/self/environ", "/proc/1/environ"]:
    try:
        with open(path, "rb") as f:
            if {secret!r}.encode() in f.read():
                found.append(path)
    except OSError as e:
        print("NO", path, type(e).__name__)
try:
    entries = [e for e in os.listdir("/proc") if e.isdigit()]
except OSError:
    entries = []
for entry in entries:
    try:
        with open(f"/proc/{{entry}}/environ", "rb") as f:
            if {secret!r}.encode() in f.read():
                found.append(entry)
    except OSError:
        pass
print("FOUND" if found else "CLEAN", sorted(os.environ), found)
""",
    "write outside scratch": """
for folder in [{open_dir!r}, {repo!r}, "/tmp"]:
    try:
        with open(folder + "/{escape}", "w") as f:
            f.write("x")
        print("WROTE", folder)
    except OSError as e:
        print("DENIED", folder, type(e).__name__)
""",
    "sockets": "{socket_probe}",
    "signal the server": """
import os, signal
try:
    os.kill({server_pid}, signal.SIGTERM)
    print("SIGNALLED")
except OSError as e:
    print("DENIED", type(e).__name__)
""",
}
# What the model must be told after each cell: all of these, and none of FORBIDDEN.
EXPECTED = {
    "infinite loop": ["KeyboardInterrupt", "[Execution timed out after 2 seconds and was interrupted"],
    "fork bomb": ["BlockingIOError: [Errno 11] Resource temporarily unavailable"],
    "10 GB allocation": ["MemoryError"],
    "server environment": ["CLEAN"],
    "write outside scratch": ["DENIED"],
    "sockets": ["tcp BLOCKED PermissionError", "udp BLOCKED PermissionError"],
    "signal the server": ["DENIED"],
}
FORBIDDEN = ["ALLOCATED", "FOUND", "WROTE", "CONNECTED", "SENT", "SIGNALLED"]


def run_python(sdk, code: str) -> tuple[object, str]:
    """One Responses request in which the model runs `code`: its code_interpreter_call item and
    the tool message the model got back."""
    response = sdk.responses.create(
        model=MODEL,
        input=code,
        include=["code_interpreter_call.outputs"],
        tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
    )
    call, message = response.output
    assert call.type == "code_interpreter_call" and call.code == code
    seen = json.loads(message.content[0].text)
    assert call.outputs[0].logs == seen  # the client sees what the model saw
    return call, seen


@pytest.fixture
def escape_targets(tmp_path):
    """Places a sandbox must not write to (a world-writable folder among them); removed after."""
    open_dir = tmp_path / "open-to-all"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (open_dir / "control.txt").write_text("writable")  # positive control
    targets = [open_dir / ESCAPE_NAME, REPO / ESCAPE_NAME, Path("/tmp") / ESCAPE_NAME]
    for path in targets:
        path.unlink(missing_ok=True)
    yield targets
    for path in targets:  # should a broken sandbox have written them
        path.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "landlock-only"])
def test_hostile_python_through_the_server(tmp_path, escape_targets, namespaces):
    secret = "sk-test-" + os.urandom(12).hex()
    listeners = Listeners()  # a TCP and a UDP socket on loopback, checked reachable
    env = {**os.environ, SECRET_NAME: secret}
    try:
        with python_tool_server_process(tmp_path, env, namespaces) as (process, hello):
            report = hello["report"]
            require(report["namespaces"] == namespaces, f"no namespaces here: {report['notes']}")
            require(report["landlock_abi"] >= 6 and report["seccomp"], f"Landlock >= 6 and seccomp needed: {report}")
            assert secret.encode() in Path(f"/proc/{process.pid}/environ").read_bytes()  # positive control
            cells = dict(HOSTILE_CELLS)
            fill = {
                "name": SECRET_NAME,
                "secret": secret,
                "server_pid": process.pid,
                "repo": str(REPO),
                "open_dir": str(escape_targets[0].parent),
                "escape": ESCAPE_NAME,
                "socket_probe": listeners.probe_code(),
            }
            with openai.OpenAI(base_url=hello["url"] + "/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
                for name, template in cells.items():
                    call, seen = run_python(sdk, template.format(**fill))
                    assert all(expected in seen for expected in EXPECTED[name]), (name, seen)
                    assert not any(word in seen for word in FORBIDDEN), (name, seen)
                    # Only a timeout is a failed call; a traceback is ordinary notebook output.
                    assert call.status == ("failed" if name == "infinite loop" else "completed"), (name, call)
                    # The server is alive and serving after each.
                    assert process.poll() is None, name
                    assert httpx.get(hello["url"] + "/health").status_code == 200
                call, seen = run_python(sdk, "print(6 * 7)")
                assert (call.status, seen) == ("completed", "42")
        assert not any(path.exists() for path in escape_targets)
        assert not listeners.tcp_arrived() and not listeners.udp_arrived()
    finally:
        listeners.close()
