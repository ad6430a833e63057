"""Every field of every tool type, given a value of the wrong shape: a 400 naming that field.

Each tool's fields are typed as OpenAI types them (nested objects included), so a bad value is
refused when the request is read, with its own `param`, never by the response built later (a
bad `user_location` read "Missing required parameter: 'tools[0].name'") nor by the tool
registry (an `allowed_tools` filter of the wrong shape was a 500).
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MODEL, LiveServer, make_app
from tests.fake_engine import ScriptedEngine
from tests.fake_tools import FakeBrowser, FakeMcp, FakePython

WEB = {"type": "web_search_preview"}
PYTHON = {"type": "code_interpreter", "container": {"type": "auto"}}
MCP = {"type": "mcp", "server_label": "weather", "require_approval": "never"}
FUNCTION = {"type": "function", "name": "get_time"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app = make_app(
        lambda: ScriptedEngine(),
        tmp_path_factory.mktemp("tool-shapes") / "r.db",
        tools=[FakeBrowser(), FakePython(), FakeMcp()],
    )
    with LiveServer(app) as live:
        yield live


# (tool, param, code)
BAD_SHAPES = [
    # function
    ({**FUNCTION, "name": 5}, "tools[0].name", "invalid_type"),
    ({**FUNCTION, "description": ["x"]}, "tools[0].description", "invalid_type"),
    ({**FUNCTION, "parameters": "object"}, "tools[0].parameters", "invalid_type"),
    ({**FUNCTION, "strict": "yes"}, "tools[0].strict", "invalid_type"),
    ({"type": "function"}, "tools[0].name", "missing_required_parameter"),
    # web search
    ({**WEB, "search_context_size": "huge"}, "tools[0].search_context_size", "invalid_value"),
    ({**WEB, "search_context_size": 3}, "tools[0].search_context_size", "invalid_value"),
    ({**WEB, "user_location": "Paris"}, "tools[0].user_location", "invalid_type"),
    ({**WEB, "user_location": ["Paris"]}, "tools[0].user_location", "invalid_type"),
    ({**WEB, "user_location": {"type": "approximate", "city": 5}}, "tools[0].user_location.city", "invalid_type"),
    ({**WEB, "user_location": {"type": "exact"}}, "tools[0].user_location.type", "invalid_value"),
    ({**WEB, "user_location": {"street": "Main St"}}, "tools[0].user_location.street", "unknown_parameter"),
    ({**WEB, "user_location": {"country": {"code": "FR"}}}, "tools[0].user_location.country", "invalid_type"),
    ({**WEB, "user_location": {"timezone": 1}}, "tools[0].user_location.timezone", "invalid_type"),
    ({**WEB, "user_location": {"region": True}}, "tools[0].user_location.region", "invalid_type"),
    ({"type": "web_search", "filters": "example.com"}, "tools[0].filters", "invalid_type"),
    (
        {"type": "web_search", "filters": {"allowed_domains": "example.com"}},
        "tools[0].filters.allowed_domains",
        "invalid_type",
    ),
    (
        {"type": "web_search", "filters": {"allowed_domains": [1]}},
        "tools[0].filters.allowed_domains[0]",
        "invalid_type",
    ),
    (
        {"type": "web_search", "filters": {"blocked_domains": []}},
        "tools[0].filters.blocked_domains",
        "unknown_parameter",
    ),
    # code interpreter
    ({**PYTHON, "container": 5}, "tools[0].container", "invalid_type"),
    ({**PYTHON, "container": ["auto"]}, "tools[0].container", "invalid_type"),
    ({**PYTHON, "container": {"type": "big"}}, "tools[0].container.type", "invalid_value"),
    ({**PYTHON, "container": {}}, "tools[0].container.type", "missing_required_parameter"),
    ({**PYTHON, "container": {"type": "auto", "file_ids": "file_1"}}, "tools[0].container.file_ids", "invalid_type"),
    (
        {**PYTHON, "container": {"type": "auto", "memory_limit": "1t"}},
        "tools[0].container.memory_limit",
        "invalid_value",
    ),
    ({**PYTHON, "container": {"type": "auto", "size": 1}}, "tools[0].container.size", "unknown_parameter"),
    # MCP
    ({**MCP, "server_label": 5}, "tools[0].server_label", "invalid_type"),
    ({"type": "mcp"}, "tools[0].server_label", "missing_required_parameter"),
    ({**MCP, "server_url": 5}, "tools[0].server_url", "invalid_type"),
    ({**MCP, "server_description": {}}, "tools[0].server_description", "invalid_type"),
    ({**MCP, "allowed_tools": 5}, "tools[0].allowed_tools", "invalid_type"),
    ({**MCP, "allowed_tools": "get_forecast"}, "tools[0].allowed_tools", "invalid_type"),
    ({**MCP, "allowed_tools": [5]}, "tools[0].allowed_tools[0]", "invalid_type"),
    ({**MCP, "allowed_tools": {"tool_names": 5}}, "tools[0].allowed_tools.tool_names", "invalid_type"),
    ({**MCP, "allowed_tools": {"tool_names": "get_forecast"}}, "tools[0].allowed_tools.tool_names", "invalid_type"),
    ({**MCP, "allowed_tools": {"tool_names": [{"name": "x"}]}}, "tools[0].allowed_tools.tool_names[0]", "invalid_type"),
    ({**MCP, "allowed_tools": {"read_only": "yes"}}, "tools[0].allowed_tools.read_only", "invalid_type"),
    ({**MCP, "allowed_tools": {"names": ["x"]}}, "tools[0].allowed_tools.names", "unknown_parameter"),
    ({**MCP, "require_approval": "sometimes"}, "tools[0].require_approval", "invalid_value"),
    ({**MCP, "require_approval": 5}, "tools[0].require_approval", "invalid_value"),
    ({**MCP, "require_approval": {"never": "all"}}, "tools[0].require_approval.never", "invalid_type"),
    (
        {**MCP, "require_approval": {"never": {"tool_names": 5}}},
        "tools[0].require_approval.never.tool_names",
        "invalid_type",
    ),
    ({**MCP, "require_approval": {"sometimes": {}}}, "tools[0].require_approval.sometimes", "unknown_parameter"),
    ({**MCP, "headers": "Bearer x"}, "tools[0].headers", "invalid_type"),
    ({**MCP, "headers": {"Authorization": 5}}, "tools[0].headers.Authorization", "invalid_type"),
]


@pytest.mark.parametrize("tool,param,code", BAD_SHAPES, ids=[f"{p}-{c}" for _, p, c in BAD_SHAPES])
def test_a_tool_field_of_the_wrong_shape_is_a_400_naming_it(server, tool, param, code):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "tools": [tool]})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error["message"]
    assert error["type"] == "invalid_request_error"
    # The same tool after a good one: the index follows it.
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "tools": [FUNCTION, tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1]" + param.removeprefix("tools[0]")


@pytest.mark.parametrize(
    "tool",
    [
        {
            **WEB,
            "user_location": {
                "type": "approximate",
                "city": "Paris",
                "country": "FR",
                "region": "IDF",
                "timezone": "Europe/Paris",
            },
            "search_context_size": "low",
        },
        {**WEB, "user_location": {"city": "Paris"}},
        {"type": "web_search", "filters": {"allowed_domains": ["example.com"]}},
        {**PYTHON, "container": {"type": "auto", "file_ids": [], "memory_limit": "1g"}},
        {**PYTHON, "container": "auto"},
        {**MCP, "allowed_tools": ["get_forecast"]},
        {**MCP, "allowed_tools": {"tool_names": ["get_forecast"]}},
        {**MCP, "allowed_tools": {"read_only": False}},
    ],
    ids=lambda t: t["type"],
)
def test_well_shaped_tool_fields_are_accepted_and_echoed(server, tool):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "tools": [tool]})
    assert r.status_code == 200, r.text[:300]
    echoed = r.json()["tools"][0]
    for key, value in tool.items():
        if key != "user_location":  # (nested objects are echoed with every field, null where not given)
            given = echoed[key]
            assert ({k: v for k, v in given.items() if v is not None} if isinstance(given, dict) else given) == value
    if "user_location" in tool:
        given = {k: v for k, v in echoed["user_location"].items() if v is not None}
        assert given == {"type": "approximate", **tool["user_location"]}


def test_allowed_tools_filter_keeps_the_named_and_the_read_only_tools(server):
    # The fake MCP server's one tool says nothing about being read-only: read_only keeps none of it.
    for allowed, listed in [
        ({"tool_names": ["get_forecast"]}, ["get_forecast"]),
        ({"tool_names": []}, []),
        ({"read_only": True}, []),
        ({"read_only": True, "tool_names": ["get_forecast"]}, []),
        ({"read_only": False, "tool_names": ["get_forecast"]}, ["get_forecast"]),
    ]:
        r = httpx.post(
            f"{server.url}/v1/responses",
            json={"model": MODEL, "input": "hi", "tools": [{**MCP, "allowed_tools": allowed}]},
        )
        assert r.status_code == 200, (allowed, r.text[:300])
        listing = next(o for o in r.json()["output"] if o["type"] == "mcp_list_tools")
        assert [t["name"] for t in listing["tools"]] == listed, allowed
