"""Fuzzing every endpoint with hostile input: the server answers 4xx (never 5xx), with an
OpenAI-style error body, and keeps serving.

Bodies: random bytes, random text, random JSON, truncated JSON, invalid UTF-8 and lone
surrogates, very deep nesting, huge strings and numbers, and real requests with some fields
swapped for values of the wrong type or shape. Paths and query strings get random ids and
parameters. Bounded (derandomized, fixed example counts, no example database) so the whole
module takes a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL, LiveServer, make_app
from tests.fake_engine import ScriptedEngine, harmony_tokens
from tests.fake_tools import FakeBrowser, FakeMcp, FakePython

pytestmark = pytest.mark.slow  # a long end-to-end run: CI runs it with `-m slow`

MAX_BYTES = 64 << 10  # small, so the huge bodies below meet the limit

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = ScriptedEngine(max_model_len=4096)
    tools = [FakeBrowser(), FakePython(), FakeMcp()]
    app = make_app(
        lambda: engine,
        tmp_path_factory.mktemp("fuzz") / "r.db",
        tools=tools,
        max_request_bytes=MAX_BYTES,
        sse_ping_seconds=60,
    )
    with LiveServer(app) as live:
        live.http = httpx.Client(base_url=live.url, timeout=60)
        # A few real responses (one background, one with function-call items) for the id fuzzing.
        live.ids = [
            live.http.post("/v1/responses", json=body).json()["id"]
            for body in (
                {"model": MODEL, "input": "hello"},
                {"model": MODEL, "input": "later", "background": True},
                {
                    "model": MODEL,
                    "input": [
                        {"role": "user", "content": "x"},
                        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c1", "output": "1"},
                    ],
                },
            )
        ]
        yield live
        live.http.close()


def assert_clean(response: httpx.Response) -> None:
    """No 5xx, and every error is `{"error": {"message", "type", "param", "code"}}`."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert "x-request-id" in response.headers
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert "Traceback" not in error["message"]


def assert_still_serving(server) -> None:
    assert server.thread.is_alive()
    assert server.http.get("/health").json() == {"status": "ok"}
    r = server.http.post("/v1/responses", json={"model": MODEL, "input": "still there?"})
    assert r.status_code == 200 and r.json()["status"] == "completed"
    r = server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "?"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"


# --- values -------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)
lone_surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=4)
huge_strings = st.sampled_from([1_000, 20_000, 60_000, 200_000]).map(lambda n: "é" * n)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# Nesting a json.dumps can still write; deeper nesting is built as text below.
wild_values = (
    json_values
    | lone_surrogates
    | huge_strings
    | st.integers(2, 200).map(nested)
    | st.sampled_from([2**63, -(2**63) - 1, 10**30, 1e308, -0.0, "", [], {}])
)

RESPONSE_FIELDS = {
    "model": st.just(MODEL),
    "input": st.sampled_from(["hi", [{"role": "user", "content": "hi"}]])
    | st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(
                    ["message", "function_call", "function_call_output", "reasoning", "mcp_call", "input_image", "nope"]
                ),
                "role": st.sampled_from(["user", "assistant", "system", "tool"]),
                "content": wild_values,
            }
        ),
        max_size=3,
    ),
    "instructions": st.text(max_size=30),
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search", "code_interpreter", "mcp", "file_search"])},
            optional={
                "name": st.text(max_size=10),
                "parameters": wild_values,
                "server_label": st.sampled_from(["weather", "x"]),
                "require_approval": wild_values,
                "allowed_tools": wild_values,
                "user_location": wild_values,
                "container": wild_values,
            },
        ),
        max_size=3,
    ),
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "name": "f"}, {"type": "mcp", "server_label": "weather"}]
    ),
    "max_output_tokens": st.integers(-5, 10**6),
    "max_tool_calls": st.integers(-5, 10),
    "temperature": st.floats(-1, 3),
    "text": st.fixed_dictionaries(
        {
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema"])},
                optional={"name": st.text(max_size=8), "schema": wild_values},
            )
        }
    ),
    "reasoning": st.fixed_dictionaries(
        {}, optional={"effort": st.sampled_from(["low", "high", "max"]), "summary": wild_values}
    ),
    "stream": st.booleans(),
    "background": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": st.text(max_size=20),
    "metadata": wild_values,
    "include": st.lists(
        st.sampled_from(["reasoning.encrypted_content", "code_interpreter_call.outputs", "x"]), max_size=2
    ),
    "truncation": st.sampled_from(["auto", "disabled"]),
    "conversation": st.text(max_size=5),
    "unknown_field": wild_values,
}

CHAT_FIELDS = {
    "model": st.just(MODEL),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"])},
            optional={
                "content": wild_values,
                "tool_calls": wild_values,
                "tool_call_id": wild_values,
                "name": st.text(max_size=10),
            },
        ),
        max_size=3,
    ),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": wild_values}), max_size=2),
    "tool_choice": wild_values,
    "n": st.integers(-1, 20),
    "stop": wild_values,
    "seed": st.integers(-(2**70), 2**70),
    "max_tokens": st.integers(-5, 10**6),
    "max_completion_tokens": st.integers(-5, 10**6),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 30),
    "logit_bias": st.dictionaries(st.text(max_size=8), st.floats(-200, 200) | wild_values, max_size=3),
    "response_format": wild_values | st.just({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    "stream": st.booleans(),
    "stream_options": wild_values,
    "temperature": st.floats(-1, 3),
    "reasoning_effort": st.sampled_from(["low", "medium", "high", "extreme"]),
    "audio": wild_values,
    "unknown_field": wild_values,
}


@st.composite
def mutated_request(draw, fields: dict, base: dict) -> bytes:
    """A real request with some fields given drawn values (well-typed or not)."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name] | wild_values) if draw(st.booleans()) else draw(fields[name])
    return json.dumps(body).encode()


def raw_bodies(base: dict) -> st.SearchStrategy[bytes]:
    valid = json.dumps(base)
    return st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.integers(0, len(valid)).map(lambda i: valid[:i].encode()),  # truncated
        st.integers(10, 100_000).map(
            lambda d: ('{"model": "%s", "input": ' % MODEL + "[" * d + "]" * d + "}").encode()
        ),
        st.integers(10, 100_000).map(lambda d: ('{"a":' * d + "1" + "}" * d).encode()),
        st.sampled_from(
            [
                b'{"model": "m", "input": "\xff\xfe"}',
                b'{"model": "m", "input": "\xed\xa0\x80"}',
                b'{"model": "m", "input": "\\ud800"}',
                b'{"model": "m", "input": "a\\udc00b"}',
                b'{"model": "m", "temperature": NaN}',
                b'{"model": "m", "max_tokens": Infinity}',
                b'{"model": "m", "seed": ' + b"9" * 5000 + b"}",
                b"\xef\xbb\xbf{}",
                b"null",
                b"",
                b'{"model": "m", "model": 1}',
                valid.encode("utf-16"),
            ]
        ),
        st.sampled_from([10_000, MAX_BYTES + 1, 4 * MAX_BYTES]).map(
            lambda n: json.dumps({**base, "instructions": "x" * n}).encode()
        ),
    )


def request_bodies(fields: dict, base: dict) -> st.SearchStrategy[bytes]:
    """Half broken bytes, half real requests with drawn fields (`a | b` would weigh by branch count)."""
    return st.booleans().flatmap(lambda raw: raw_bodies(base) if raw else mutated_request(fields, base))


RESPONSE_BASE = {"model": MODEL, "input": "hello"}
CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])


@FUZZ
@given(body=request_bodies(RESPONSE_FIELDS, RESPONSE_BASE), content_type=content_types)
def test_create_response_survives_anything(server, body, content_type):
    assert_clean(server.http.post("/v1/responses", content=body, headers={"content-type": content_type}))


@FUZZ
@given(body=request_bodies(CHAT_FIELDS, CHAT_BASE), content_type=content_types)
def test_chat_completions_survive_anything(server, body, content_type):
    assert_clean(server.http.post("/v1/chat/completions", content=body, headers={"content-type": content_type}))


response_ids = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["resp_", "resp_" + "0" * 5000, "..", "%00", "a/b"]),
    st.text(max_size=20).map(lambda t: "resp_" + t),
)
query_values = st.one_of(
    st.text(max_size=30),
    st.integers(-(2**80), 2**80).map(str),
    st.sampled_from(["true", "false", "-1", "0", "1e3", "asc", "desc", "", "\x00"]),
)
queries = st.dictionaries(
    st.sampled_from(["stream", "starting_after", "limit", "order", "after", "include", "x"]), query_values, max_size=4
)


@FUZZ
@given(data=st.data(), action=st.sampled_from(["get", "delete", "cancel", "input_items"]), query=queries)
def test_response_endpoints_survive_any_id_and_query(server, data, action, query):
    response_id = data.draw(st.sampled_from(server.ids) | response_ids)
    path = f"/v1/responses/{quote(response_id, safe='')}"
    if action == "get":
        r = server.http.get(path, params=query)
    elif action == "delete":
        r = server.http.delete(path, params=query)
    elif action == "cancel":
        r = server.http.post(f"{path}/cancel", params=query, content=data.draw(st.binary(max_size=50)))
    else:
        r = server.http.get(f"{path}/input_items", params=query)
    assert_clean(r)


@FUZZ
@given(
    path=st.sampled_from(
        [
            "/v1/models",
            "/health",
            "/ready",
            "/metrics",
            "/v1/responses",
            "/v1/chat/completions",
            "/v1/models/",
            "/",
            "/v1",
            "/v1/responses/x/y/z",
        ]
    )
    | st.text(max_size=40).map(lambda t: "/v1/models/" + quote(t, safe="")),
    method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]),
    query=queries,
    body=st.binary(max_size=100),
)
def test_other_endpoints_survive_any_method_and_query(server, path, method, query, body):
    r = server.http.request(method, path, params=query, content=body if method not in ("GET", "HEAD") else None)
    assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
    if r.status_code >= 400 and method != "HEAD" and r.headers.get("content-type", "").startswith("application/json"):
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_still_serves_after_the_fuzzing(server):
    # Runs last in this module (pytest keeps file order): everything above must have left it healthy.
    assert_still_serving(server)
    assert server.http.get("/v1/models").status_code == 200 and server.http.get("/ready").status_code == 200
    assert server.http.get(f"/v1/responses/{server.ids[0]}").status_code in (200, 404)  # 404: fuzzed DELETE
    deadline = time.monotonic() + 10
    while server.state.runs.runs or server.engine.running:  # background runs the fuzzing started all end
        assert time.monotonic() < deadline, (server.state.runs.runs, server.engine.running)
        time.sleep(0.01)


# --- all at once ------------------------------------------------------------------------------

STREAMS = 64
MALFORMED = 300
LOAD_SECONDS = 120  # the whole round, bounded


@pytest.fixture(scope="module")
def paced_server(tmp_path_factory):
    """A server of its own whose answers take a second or two (a token every 5 ms)."""
    engine = ScriptedEngine(max_model_len=4096, token_delay=0.005)
    answer = harmony_tokens(
        "<|channel|>analysis<|message|>" + "think " * 40 + "<|end|><|start|>assistant"
        "<|channel|>final<|message|>" + "word " * 200 + "<|return|>"
    )
    engine.say(*[answer] * (4 * STREAMS))
    app = make_app(
        lambda: engine,
        tmp_path_factory.mktemp("load") / "r.db",
        tools=[FakeBrowser(), FakePython(), FakeMcp()],
        max_request_bytes=MAX_BYTES,
        sse_ping_seconds=60,
    )
    with LiveServer(app) as live:
        live.http = httpx.Client(base_url=live.url, timeout=60)
        yield live
        live.http.close()


async def stream_and_maybe_hang_up(client: httpx.AsyncClient, api: str, read: int | None) -> dict:
    """One streaming request; `read`: events to read before hanging up (None: to the end)."""
    from agent_server.bench.serve import sse_events

    if api == "chat":
        path, body = "/v1/chat/completions", {**CHAT_BASE, "stream": True}
    else:
        path, body = "/v1/responses", {**RESPONSE_BASE, "stream": True, "background": read == 0}
    events: list[dict] = []
    async with client.stream("POST", path, json=body) as response:
        status = response.status_code
        if status == 200:
            async for data in sse_events(response):
                if data != "[DONE]":
                    events.append(json.loads(data))
                if read is not None and len(events) >= max(read, 1):
                    break
        else:
            await response.aread()
    return {"api": api, "status": status, "events": events, "cut": read is not None}


async def malformed(
    client: httpx.AsyncClient, limit: asyncio.Semaphore, path: str, body: bytes, content_type: str
) -> httpx.Response:
    async with limit:
        return await client.post(path, content=body, headers={"content-type": content_type})


# Values of every kind and shape, for the fields of the malformed bodies below.
WILD = [
    None,
    True,
    0,
    -1,
    2**63,
    1e308,
    -0.0,
    "",
    "x",
    "\ud800",
    "é" * 20_000,
    [],
    {},
    [[[]]],
    {"a": {"b": [1]}},
    [{"role": "user"}],
    {"type": "function"},
    "gpt-oss-test",
    [None],
    {"": ""},
]
RAW = [
    b"",
    b"null",
    b"[]",
    b"\xef\xbb\xbf{}",
    b'{"model": "m", "input": "\xff\xfe"}',
    b'{"model": NaN}',
    b'{"model": "m", "temperature": Infinity}',
    b'{"a": 1} trailing',
    b"{" * 5000,
    b'{"model": "m", "seed": ' + b"9" * 5000 + b"}",
    json.dumps({"x": "y"}).encode("utf-16"),
]


def malformed_bodies(rng: random.Random, base: dict, fields: list[str], count: int) -> list[tuple[bytes, str]]:
    """(body, content type) of requests that are wrong in one of many ways (seeded: the same
    every run). A field swapped for a WILD value is sometimes a valid request all the same."""
    valid = json.dumps(base).encode()
    makers = [
        lambda: rng.randbytes(rng.randint(0, 300)),
        lambda: valid[: rng.randint(0, len(valid) - 1)],
        lambda: json.dumps(rng.choice(WILD)).encode(),
        lambda: json.dumps(
            {**base, **{rng.choice(fields): rng.choice(WILD) for _ in range(rng.randint(1, 4))}}
        ).encode(),
        lambda: json.dumps({**base, "unknown_field": rng.choice(WILD)}).encode(),
        lambda: json.dumps({k: v for k, v in base.items() if k != rng.choice(list(base))}).encode(),
        lambda: (('{"model": "%s", "input": ' % MODEL) + "[" * (d := rng.randint(50, 50_000)) + "]" * d + "}").encode(),
        lambda: json.dumps({**base, "instructions": "y" * rng.choice([70_000, 200_000])}).encode(),
        lambda: rng.choice(RAW),
    ]
    content_types = ["application/json"] * 6 + ["text/plain", "application/x-www-form-urlencoded", ""]
    return [(rng.choice(makers)(), rng.choice(content_types)) for _ in range(count)]


def test_streams_with_disconnects_and_malformed_bodies_all_at_once(paced_server):
    """64 streams (Responses and Chat, a quarter read to the end, the rest cut after a random
    number of events, some of them background responses) and 300 malformed bodies, at once:
    no 5xx anywhere, every malformed body a 4xx with an OpenAI-style error, every stream read to
    its end well formed, every stored response stored with a final status, and the server idle
    and serving afterwards."""
    server, rng = paced_server, random.Random(45)
    bodies = [
        ("/v1/responses", *b) for b in malformed_bodies(rng, RESPONSE_BASE, list(RESPONSE_FIELDS), MALFORMED // 2)
    ]
    bodies += [
        ("/v1/chat/completions", *b) for b in malformed_bodies(rng, CHAT_BASE, list(CHAT_FIELDS), MALFORMED // 2)
    ]
    plan = [
        ("chat" if i % 2 else "responses", rng.choice([None, rng.randint(0, 120)]) if i % 4 else None)
        for i in range(STREAMS)
    ]
    errors_before = server_errors(server)

    async def round_() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            limit = asyncio.Semaphore(32)
            streams = [asyncio.create_task(stream_and_maybe_hang_up(client, api, read)) for api, read in plan]
            answers = [asyncio.create_task(malformed(client, limit, *b)) for b in bodies]
            return await asyncio.gather(*streams), await asyncio.gather(*answers)

    started = time.monotonic()
    streams, answers = asyncio.run(asyncio.wait_for(round_(), LOAD_SECONDS))
    assert time.monotonic() - started < LOAD_SECONDS

    for answer in answers:
        assert_clean(answer)
        assert answer.status_code != 200 or answer.request.headers.get("content-type") == "application/json"
    assert sum(a.status_code >= 400 for a in answers) > MALFORMED // 2  # (some mutated bodies are valid requests)
    for result in streams:
        assert result["status"] == 200, result
        if not result["cut"]:
            last = result["events"][-1]
            if result["api"] == "chat":
                assert last["choices"][-1]["finish_reason"] is not None or last.get("usage"), last
            else:
                assert last["type"] == "response.completed", last["type"]

    # Every stored response of the round ends with a final status (a cut foreground stream is
    # cancelled, a background one runs on), and nothing is left running.
    ids = {r["events"][0]["response"]["id"] for r in streams if r["api"] == "responses" and r["events"]}
    deadline = time.monotonic() + 60
    while server.state.runs.runs or server.engine.running:
        assert time.monotonic() < deadline, list(server.state.runs.runs)
        time.sleep(0.05)
    for response_id in ids:
        stored = server.http.get(f"/v1/responses/{response_id}").json()
        assert stored["status"] in ("completed", "cancelled"), stored
    assert server_errors(server) == errors_before == 0
    assert_still_serving(server)


def server_errors(server) -> float:
    """5xx answers the server counted (its /metrics), but /ready's while the model loaded."""
    from agent_server.bench.server_metrics import parse_metrics

    samples = parse_metrics(server.http.get("/metrics").text)
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "oss_agent_requests_total"
        and dict(labels)["status"].startswith("5")
        and dict(labels)["endpoint"] != "/ready"
    )
