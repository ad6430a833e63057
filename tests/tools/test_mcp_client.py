"""The MCP client against a real `mcp` server (MCPServer, formerly FastMCP) over streamable HTTP
on loopback: listing, Harmony namespaces, calls, errors, timeouts, reconnection."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import uvicorn
from mcp.server.mcpserver import MCPServer
from openai_harmony import Conversation, Message, Role, SystemContent

from inference.tokenizer import harmony_encoding
from tools.mcp_client import McpToolServer, namespace_name, parse_mcp_spec
from tools.protocol import ToolSessionGroup
from tools.servers import ToolServerError, start_tool_servers


def make_server() -> MCPServer:
    server = MCPServer("Unit Conversions", instructions="Convert between units.", log_level="WARNING")

    @server.tool()
    def celsius_to_fahrenheit(celsius: float) -> float:
        """Convert a temperature from Celsius to Fahrenheit."""
        return celsius * 9 / 5 + 32

    @server.tool()
    def describe(items: list[str], upper: bool = False) -> dict:
        """Count and join some items."""
        joined = ", ".join(items)
        return {"count": len(items), "joined": joined.upper() if upper else joined}

    @server.tool()
    def fail(reason: str) -> str:
        """Always fails."""
        raise ValueError(reason)

    @server.tool()
    async def wait(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "awake"

    return server


async def serve(app, port: int = 0):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def stop(server, task):
    server.should_exit = server.force_exit = True
    await task


@pytest.fixture
async def mcp_port():
    server, task, port = await serve(make_server().streamable_http_app())
    yield port
    await stop(server, task)


def test_spec_parsing_and_names():
    assert parse_mcp_spec("localhost:8001") == (None, "http://localhost:8001/mcp")
    assert parse_mcp_spec("https://tools.example.com") == (None, "https://tools.example.com/mcp")
    assert parse_mcp_spec("http://h:9/custom/path") == (None, "http://h:9/custom/path")
    assert parse_mcp_spec("weather=h:9") == ("weather", "http://h:9/mcp")
    assert parse_mcp_spec("http://h:9/mcp?key=a=b") == (None, "http://h:9/mcp?key=a=b")
    for bad in ("localhost", "ftp://h/x", "h:port"):
        with pytest.raises(ValueError):
            parse_mcp_spec(bad)
    assert namespace_name("Unit Conversions", []) == "Unit_Conversions"
    assert namespace_name("browser", ["browser", "python"]) == "browser_2"
    assert namespace_name("3d tools", []) == "mcp_3d_tools"


async def test_list_and_call_tools(mcp_port):
    (server,) = await start_tool_servers([f"127.0.0.1:{mcp_port}"], mcp_timeout=5)
    try:
        assert (server.kind, server.name) == ("mcp", "Unit_Conversions")
        listed = {t["name"]: t for t in server.listed_tools()}
        assert set(listed) == {"celsius_to_fahrenheit", "describe", "fail", "wait"}
        assert listed["celsius_to_fahrenheit"]["description"] == "Convert a temperature from Celsius to Fahrenheit."
        assert listed["describe"]["input_schema"]["required"] == ["items"]
        assert listed["describe"]["input_schema"]["properties"]["items"]["type"] == "array"

        # The namespace renders into a Harmony system message the model can read.
        namespace = server.harmony_namespace()
        system = SystemContent.new().with_tools(namespace)
        encoding = harmony_encoding()
        rendered = encoding.decode_utf8(
            encoding.render_conversation(
                Conversation.from_messages([Message.from_role_and_content(Role.SYSTEM, system)])
            )
        )
        assert "## Unit_Conversions\n\n// Convert between units.\nnamespace Unit_Conversions {" in rendered
        assert "type celsius_to_fahrenheit = (_: {\ncelsius: number,\n}) => any;" in rendered

        session = server.open_session()
        result = await session.call("Unit_Conversions.celsius_to_fahrenheit", '{"celsius": 100}')
        assert (result.text, result.is_error) == ("212.0", False)
        assert result.details == {
            "server_label": "Unit_Conversions",
            "name": "celsius_to_fahrenheit",
            "arguments": '{"celsius": 100}',
            "output": "212.0",
            "error": None,
        }
        result = await session.call("Unit_Conversions.describe", '{"items": ["a", "b"], "upper": true}')
        assert json.loads(result.text) == {"count": 2, "joined": "A, B"}

        # Failures reach the model as tool errors.
        result = await session.call("Unit_Conversions.fail", '{"reason": "no"}')
        assert result.is_error and "Error executing tool fail" in result.text
        assert result.details["error"] == result.text and result.details["output"] is None
        result = await session.call("Unit_Conversions.celsius_to_fahrenheit", '{"celsius": "hot"}')
        assert result.is_error and "validation error" in result.text
        result = await session.call("Unit_Conversions.nope", "{}")
        assert result.is_error and "has: celsius_to_fahrenheit, describe, fail, wait" in result.text
        result = await session.call("Unit_Conversions.describe", "[1]")
        assert result.is_error and "expected a JSON object" in result.text
    finally:
        await server.aclose()


async def test_slow_tool_times_out_and_calls_run_from_other_tasks(mcp_port):
    server = await McpToolServer.start(f"http://127.0.0.1:{mcp_port}/mcp", label="units", timeout=1.0)
    try:
        group = ToolSessionGroup([server])
        result = await group.call("units.wait", '{"seconds": 3}')
        assert result.is_error and "did not answer within 1 seconds" in result.text
        # Calls from several tasks at once share the one connection.
        results = await asyncio.gather(
            *(
                asyncio.create_task(group.call("units.celsius_to_fahrenheit", json.dumps({"celsius": c})))
                for c in (0, 10, 20)
            )
        )
        assert [r.text for r in results] == ["32.0", "50.0", "68.0"]
    finally:
        await server.aclose()


async def test_reconnects_after_the_server_restarts():
    http, task, port = await serve(make_server().streamable_http_app())
    server = await McpToolServer.start(f"http://127.0.0.1:{port}/mcp", timeout=5)
    try:
        session = server.open_session()
        assert (await session.call(f"{server.name}.celsius_to_fahrenheit", '{"celsius": 0}')).text == "32.0"
        await stop(http, task)
        result = await session.call(f"{server.name}.celsius_to_fahrenheit", '{"celsius": 0}')
        assert result.is_error and "Calling" in result.text  # down: an error, not an exception
        http, task, _ = await serve(make_server().streamable_http_app(), port=port)
        result = await session.call(f"{server.name}.celsius_to_fahrenheit", '{"celsius": 5}')
        assert (result.text, result.is_error) == ("41.0", False)
    finally:
        await server.aclose()
        await stop(http, task)


async def test_unreachable_server_fails_start():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(ToolServerError, match=f"cannot reach the MCP server at http://127.0.0.1:{port}/mcp"):
        await start_tool_servers([f"127.0.0.1:{port}"], mcp_timeout=5)
    with pytest.raises(ToolServerError, match="expected demo, browser, python, host:port, an http"):
        await start_tool_servers(["nonsense"])


def test_tool_server_values_are_checked_before_anything_starts():
    # (`serve --tool-server bogus` started uvicorn, then failed with two chained tracebacks; the
    # list of valid values it gave left out browser and python)
    from tools.servers import check_specs

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    check_specs(["demo", "browser,python"])
    with pytest.raises(ToolServerError) as bogus:
        check_specs(["demo", "bogus"])
    assert str(bogus.value) == (
        "expected demo, browser, python, host:port, an http(s):// URL, or label=<host:port "
        "or URL> for a tool server, got 'bogus'"
    )
    with pytest.raises(ToolServerError) as closed:
        check_specs([f"weather=127.0.0.1:{port}"])
    assert str(closed.value).startswith(
        f"cannot reach the MCP server 'weather=127.0.0.1:{port}' at http://127.0.0.1:{port}/mcp: "
    )


async def test_demo_and_mcp_together(mcp_port, monkeypatch):
    monkeypatch.delenv("EXA_API_KEY", raising=False)
    servers = await start_tool_servers([f"demo,browser=127.0.0.1:{mcp_port}"], mcp_timeout=5)
    try:
        assert [(s.kind, s.name) for s in servers] == [
            ("browser", "browser"),
            ("python", "python"),
            ("mcp", "browser_2"),
        ]
        group = ToolSessionGroup(servers)
        assert (await group.call("python", "6 * 7")).text == "42"
        assert (await group.call("browser_2.celsius_to_fahrenheit", '{"celsius": -40}')).text == "-40.0"
        assert not (await group.call("browser.search", '{"query": "gpt-oss experts"}')).is_error
        await group.close()
    finally:
        for server in servers:
            await server.aclose()
