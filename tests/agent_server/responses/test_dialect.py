"""The Responses API under `/openresponses/v1`: the Open Responses specification's dialect of the
stream (`agent_server/responses/dialect.py`), and `/v1` left as OpenAI's.

The OpenResponses compliance suite (its `bin/compliance-test.ts`, run with bun against a base
URL; README's compatibility table has the runs) is not on a registry CI reaches, so these tests
check what it checks, from the raw bytes: every event of its scenarios, over SSE and the
WebSocket, against what the specification (release 2026-04-24, `schema/components/schemas`)
requires of it (`SPEC_EVENTS`, `RESOURCE`, `ITEMS`), and the same requests on `/v1` against the
`openai` SDK's own types, strictly.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from websockets.sync.client import connect

from tests.agent_server.responses.test_matrix import parse_sse
from tests.conftest import MODEL, LiveServer, make_app, wait_for
from tests.fake_engine import ScriptedEngine

SPEC = "/openresponses/v1"
REASONED = (
    "<|channel|>analysis<|message|>A short answer will do.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Hello there, friend.<|return|>"
)
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
}
WEATHER_CALL = (
    "<|channel|>analysis<|message|>I need the tool.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"location": "San Francisco, CA"}<|call|>'
)

# The events the suite validates a stream against (its sse-parser's union), each with the fields
# the specification requires and their JSON types (None: an object or a union, checked apart).
SPEC_EVENTS: dict[str, dict[str, str | None]] = {
    **{
        kind: {"sequence_number": "integer", "response": "object"}
        for kind in (
            "response.created",
            "response.queued",
            "response.in_progress",
            "response.completed",
            "response.failed",
            "response.incomplete",
        )
    },
    "response.output_item.added": {"sequence_number": "integer", "output_index": "integer", "item": "object"},
    "response.output_item.done": {"sequence_number": "integer", "output_index": "integer", "item": "object"},
    **{
        kind: {
            "sequence_number": "integer",
            "item_id": "string",
            "output_index": "integer",
            "content_index": "integer",
            "part": "object",
        }
        for kind in ("response.content_part.added", "response.content_part.done")
    },
    "response.output_text.delta": {
        "sequence_number": "integer",
        "item_id": "string",
        "output_index": "integer",
        "content_index": "integer",
        "delta": "string",
    },
    "response.output_text.done": {
        "sequence_number": "integer",
        "item_id": "string",
        "output_index": "integer",
        "content_index": "integer",
        "text": "string",
    },
    "response.function_call_arguments.delta": {
        "sequence_number": "integer",
        "item_id": "string",
        "output_index": "integer",
        "delta": "string",
    },
    "response.function_call_arguments.done": {
        "sequence_number": "integer",
        "item_id": "string",
        "output_index": "integer",
        "arguments": "string",
    },
    "response.reasoning.delta": {
        "sequence_number": "integer",
        "item_id": "string",
        "output_index": "integer",
        "content_index": "integer",
        "delta": "string",
    },
    "response.reasoning.done": {
        "sequence_number": "integer",
        "item_id": "string",
        "output_index": "integer",
        "content_index": "integer",
        "text": "string",
    },
    "response.output_text.annotation.added": {
        "sequence_number": "integer",
        "item_id": "string",
        "output_index": "integer",
        "content_index": "integer",
        "annotation_index": "integer",
        "annotation": "object",
    },
}
# Every field the specification defines for its reasoning events (the optional `obfuscation` we
# do not send): nothing else may be there.
REASONING_FIELDS = {
    "response.reasoning.delta": {"type", "sequence_number", "item_id", "output_index", "content_index", "delta"},
    "response.reasoning.done": {"type", "sequence_number", "item_id", "output_index", "content_index", "text"},
}
RESOURCE = (  # ResponseResource's required fields
    "id object created_at completed_at status incomplete_details model previous_response_id instructions output "
    "error tools tool_choice truncation parallel_tool_calls text top_p presence_penalty frequency_penalty "
    "top_logprobs temperature reasoning user usage max_output_tokens max_tool_calls store background service_tier "
    "metadata safety_identifier prompt_cache_key"
).split()
ITEMS = {  # required fields of the output items and content parts these scenarios produce
    "message": {"type", "id", "status", "role", "content"},
    "function_call": {"type", "id", "call_id", "name", "arguments", "status"},
    "reasoning": {"type", "id", "summary"},
    "output_text": {"type", "text", "annotations"},
    "reasoning_text": {"type", "text"},
    "compaction": {"type", "id", "encrypted_content"},
}
COMPACT_RESOURCE = {"id", "object", "output", "created_at", "usage"}
USAGE = {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details", "output_tokens_details"}
JSON_TYPES = {"integer": int, "string": str, "object": dict, "array": list}
SDK_EVENT = TypeAdapter(ResponseStreamEvent)


def spec_problems(event: dict[str, Any], where: str = "") -> list[str]:
    """What in one event (as sent on the spec prefix) the specification does not allow."""
    kind = event.get("type")
    if kind not in SPEC_EVENTS:
        return [f"{where}{kind}: not an event of the specification"]
    problems = []
    for field, json_type in SPEC_EVENTS[kind].items():
        value = event.get(field)
        if field not in event or not isinstance(value, JSON_TYPES[json_type]) or isinstance(value, bool):
            problems.append(f"{where}{kind}: '{field}' missing or not {json_type}")
    if kind in REASONING_FIELDS and set(event) != REASONING_FIELDS[kind]:
        problems.append(f"{where}{kind}: fields {sorted(event)}")
    if "response" in event:
        problems += resource_problems(event["response"], f"{where}{kind}.response: ")
    for key in ("item", "part"):
        if isinstance(event.get(key), dict):
            problems += item_problems(event[key], f"{where}{kind}.{key}: ")
    for entry in event.get("logprobs") or []:
        for one in (entry, *entry.get("top_logprobs", [])):
            if not {"token", "logprob", "bytes"} <= set(one):
                problems.append(f"{where}{kind}: a logprob without {sorted({'token', 'logprob', 'bytes'} - set(one))}")
    return problems


def item_problems(item: dict[str, Any], where: str = "") -> list[str]:
    missing = ITEMS.get(item.get("type"), set()) - set(item)
    problems = [f"{where}{item.get('type')} lacks {sorted(missing)}"] if missing else []
    for part in item.get("content") or []:
        problems += item_problems(part, where)
    return problems


def resource_problems(response: dict[str, Any], where: str = "") -> list[str]:
    problems = [f"{where}lacks '{field}'" for field in RESOURCE if field not in response]
    if response.get("object") != "response":
        problems.append(f"{where}object is {response.get('object')!r}")
    if not isinstance(response.get("created_at"), int):
        problems.append(f"{where}created_at is not an integer")
    if response.get("usage") is not None and not USAGE <= set(response["usage"]):
        problems.append(f"{where}usage lacks {sorted(USAGE - set(response['usage']))}")
    for item in response.get("output") or []:
        problems += item_problems(item, where)
    return problems


def sse_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with httpx.Client(timeout=60, headers=headers) as http:
        r = http.post(url, json={**body, "stream": True})
        assert r.status_code == 200, r.text
        return parse_sse(r.content)[0]


def ws_turn(socket, message: dict[str, Any]) -> list[dict[str, Any]]:
    """One response's events over a WebSocket (or the error event), as JSON."""
    socket.send(json.dumps(message))
    events = []
    while True:
        events.append(json.loads(socket.recv(timeout=60)))
        if events[-1]["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
            return events


def ws_url(server, prefix: str) -> str:
    return server.url.replace("http://", "ws://") + prefix + "/responses"


def renamed(kind: str) -> str:
    return {"response.reasoning_text.delta": "response.reasoning.delta"}.get(
        kind, {"response.reasoning_text.done": "response.reasoning.done"}.get(kind, kind)
    )


# --- the stream, SSE and WebSocket -----------------------------------------------------------


def test_the_stream_follows_the_spec_on_its_prefix_and_openai_on_v1(fake_server):
    engine = fake_server.engine
    body = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}]}
    engine.say(REASONED, REASONED)
    spec = sse_stream(f"{fake_server.url}{SPEC}/responses", body)
    openai = sse_stream(f"{fake_server.url}/v1/responses", body)

    assert [p for e in spec for p in spec_problems(e)] == []
    kinds = [e["type"] for e in spec]
    assert kinds.count("response.reasoning.delta") >= 2 and kinds.count("response.reasoning.done") == 1
    done = next(e for e in spec if e["type"] == "response.reasoning.done")
    assert done["text"] == "A short answer will do." and done["content_index"] == 0 and done["output_index"] == 0
    assert done["item_id"] == spec[-1]["response"]["output"][0]["id"]
    assert "".join(e["delta"] for e in spec if e["type"] == "response.reasoning.delta") == done["text"]
    assert spec[-1]["type"] == "response.completed" and spec[-1]["response"]["status"] == "completed"

    # /v1: OpenAI's names, every event as the SDK types it (strictly), the same stream otherwise.
    for event in openai:
        SDK_EVENT.validate_python(event, strict=True)
    assert "response.reasoning_text.delta" in [e["type"] for e in openai]
    assert not {"response.reasoning.delta", "response.reasoning.done"} & {e["type"] for e in openai}
    assert [renamed(e["type"]) for e in openai] == kinds
    strip = lambda e: {k: v for k, v in e.items() if k not in ("type", "item_id", "item", "response")}  # noqa: E731
    assert [strip(e) for e in openai] == [strip(e) for e in spec]


def test_logprobs_carry_their_bytes_on_the_spec_prefix_only(fake_server):
    engine = fake_server.engine
    body = {
        "model": MODEL,
        "input": "Hi",
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
    }
    engine.say(REASONED, REASONED)
    spec = sse_stream(f"{fake_server.url}{SPEC}/responses", body)
    openai = sse_stream(f"{fake_server.url}/v1/responses", body)
    assert [p for e in spec for p in spec_problems(e)] == []
    part = spec[-1]["response"]["output"][-1]["content"][0]
    for stream, with_bytes in ((spec, True), (openai, False)):
        deltas = [lp for e in stream if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
        done = next(e for e in stream if e["type"] == "response.output_text.done")["logprobs"]
        assert len(deltas) == len(done) == len(part["logprobs"]) > 0
        for entries in (deltas, done):
            for entry, full in zip(entries, part["logprobs"]):
                keys = {"token", "logprob", "bytes"} if with_bytes else {"token", "logprob"}
                assert set(entry) == keys | {"top_logprobs"} and entry["token"] == full["token"]
                assert all(set(top) == keys for top in entry["top_logprobs"]) and len(entry["top_logprobs"]) == 2
                if with_bytes:
                    assert entry["bytes"] == full["bytes"]
                    assert [t["bytes"] for t in entry["top_logprobs"]] == [t["bytes"] for t in full["top_logprobs"]]


def test_the_websocket_follows_the_spec_on_its_prefix_and_openai_on_v1(fake_server):
    engine = fake_server.engine
    create = {"type": "response.create", "model": MODEL, "input": "Count from 1 to 3."}
    engine.say(REASONED, REASONED, REASONED)
    sse = sse_stream(f"{fake_server.url}{SPEC}/responses", {"model": MODEL, "input": "Count from 1 to 3."})
    with connect(ws_url(fake_server, SPEC)) as socket:
        spec = ws_turn(socket, create)
        assert [p for e in spec for p in spec_problems(e, "ws ")] == []
        assert [e["type"] for e in spec] == [e["type"] for e in sse]
        # Errors: the spec's WebSocket error event, whose `code` is a string even where OpenAI's is null.
        missing = ws_turn(
            socket, {**create, "store": False, "previous_response_id": "resp_openresponses_missing", "input": "x"}
        )
        assert missing == [
            {
                "type": "error",
                "status": 404,
                "error": {
                    "message": "Previous response with id 'resp_openresponses_missing' not found.",
                    "type": "invalid_request_error",
                    "param": "previous_response_id",
                    "code": "previous_response_not_found",
                },
            }
        ]
        both = {**create, "previous_response_id": "resp_1", "conversation": "conv_1"}
        error = ws_turn(socket, both)[-1]
        assert error["status"] == 400 and error["error"]["code"] == "invalid_request_error"
    with connect(ws_url(fake_server, "/v1")) as socket:
        openai = ws_turn(socket, create)
        for event in openai:
            SDK_EVENT.validate_python(event, strict=True)
        assert [renamed(e["type"]) for e in openai] == [e["type"] for e in spec]
        assert ws_turn(socket, both)[-1]["error"]["code"] is None  # (unchanged on /v1)


# --- the suite's scenarios on the spec prefix -----------------------------------------------


def post(server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{SPEC}{path}", json=body, timeout=60)


def test_the_suites_http_scenarios(fake_server):
    engine = fake_server.engine
    message = lambda role, text: {"type": "message", "role": role, "content": text}  # noqa: E731
    scenarios = {
        "basic-response": [message("user", "Say hello in exactly 3 words.")],
        "assistant-phase": [
            {**message("assistant", "I should answer with the saved number."), "phase": "commentary"},
            {**message("assistant", "The number is four."), "phase": "final_answer"},
            message("user", "Repeat only the number."),
        ],
        "system-prompt": [
            message("system", "You are a pirate. Always respond in pirate speak."),
            message("user", "Say hello."),
        ],
        "multi-turn": [
            message("user", "My name is Alice."),
            message("assistant", "Hello Alice! Nice to meet you. How can I help you today?"),
            message("user", "What is my name?"),
        ],
    }
    for name, items in scenarios.items():
        engine.say(REASONED)
        r = post(fake_server, "/responses", {"model": MODEL, "input": items})
        assert r.status_code == 200, (name, r.text)
        assert resource_problems(r.json(), f"{name}: ") == []
        assert r.json()["status"] == "completed" and r.json()["output"], name

    engine.say(WEATHER_CALL)
    r = post(
        fake_server,
        "/responses",
        {
            "model": MODEL,
            "input": [message("user", "What's the weather like in San Francisco?")],
            "tools": [WEATHER_TOOL],
        },
    )
    assert resource_problems(r.json()) == []
    call = r.json()["output"][-1]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"location": "San Francisco, CA"}
    assert {"type", "name", "description", "parameters", "strict"} <= set(r.json()["tools"][0])  # (FunctionTool)

    engine.say(WEATHER_CALL)
    streamed = sse_stream(
        f"{fake_server.url}{SPEC}/responses",
        {"model": MODEL, "input": "Weather?", "tools": [WEATHER_TOOL]},
    )
    assert [p for e in streamed for p in spec_problems(e)] == []
    assert "response.function_call_arguments.done" in [e["type"] for e in streamed]

    # Image input: refused by design, with a 400 that names it.
    image = [
        {"type": "input_text", "text": "What do you see in this image?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
    ]
    r = post(fake_server, "/responses", {"model": MODEL, "input": [message("user", image)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[1]"
    assert "'input_image' inputs are not supported" in r.json()["error"]["message"]

    # Compaction: the compact resource, its compaction item; a request without a model is a 400.
    engine.say("<|channel|>final<|message|>They launch on Tuesday.<|return|>")
    history = [
        message("user", "We agreed to launch on Tuesday and notify support first."),
        message("assistant", "Understood. The launch is Tuesday, with support notified beforehand."),
    ]
    r = post(
        fake_server,
        "/responses/compact",
        {"model": MODEL, "prompt_cache_key": "openresponses-compact-test", "input": history},
    )
    compacted = r.json()
    assert r.status_code == 200 and COMPACT_RESOURCE <= set(compacted), r.text
    assert compacted["object"] == "response.compaction" and USAGE <= set(compacted["usage"])
    assert [item_problems(item) for item in compacted["output"]] == [[] for _ in compacted["output"]]
    assert compacted["output"][-1]["type"] == "compaction"
    assert post(fake_server, "/responses/compact", {"input": history}).status_code == 400


def test_the_suites_websocket_scenarios(fake_server):
    engine = fake_server.engine
    create = {"type": "response.create", "model": MODEL, "store": False}
    engine.say(*[REASONED] * 6)
    with connect(ws_url(fake_server, SPEC)) as socket:
        first = ws_turn(socket, {**create, "input": "Reply with exactly: first"})
        second = ws_turn(socket, {**create, "input": "Reply with exactly: second"})
        for turn in (first, second):
            assert [p for e in turn for p in spec_problems(e)] == []
            assert turn[-1]["type"] == "response.completed"
        # Continuation on the same connection, with only the new input.
        go_on = ws_turn(
            socket, {**create, "previous_response_id": second[-1]["response"]["id"], "input": "And the code word?"}
        )
        assert go_on[-1]["type"] == "response.completed" and go_on[-1]["response"]["previous_response_id"]
        # A failed continuation evicts the response it named.
        kept = go_on[-1]["response"]["id"]
        bad = {"type": "function_call_output", "call_id": "call_missing", "output": "?"}
        assert ws_turn(socket, {**create, "previous_response_id": kept, "input": [bad]})[-1]["type"] == "error"
        evicted = ws_turn(socket, {**create, "previous_response_id": kept, "input": "again"})[-1]
        assert evicted["error"]["code"] == "previous_response_not_found" and evicted["status"] == 404
    # A new connection does not know the first one's store=false responses; a clean one then works.
    with connect(ws_url(fake_server, SPEC)) as socket:
        lost = ws_turn(socket, {**create, "previous_response_id": first[-1]["response"]["id"], "input": "x"})[-1]
        assert lost["type"] == "error" and lost["error"]["code"] == "previous_response_not_found"
        recovered = ws_turn(socket, {**create, "input": "Start over."})
        assert recovered[-1]["type"] == "response.completed"
        # Compaction's output as the base input of a new chain.
        engine.say("<|channel|>final<|message|>Code word: cobalt.<|return|>", REASONED)
        compacted = post(fake_server, "/responses/compact", {"model": MODEL, "input": "Remember: cobalt."}).json()
        chain = ws_turn(
            socket, {**create, "input": [*compacted["output"], {"type": "message", "role": "user", "content": "Word?"}]}
        )
        assert [p for e in chain for p in spec_problems(e)] == [] and chain[-1]["type"] == "response.completed"


# --- one server: routes, auth, store ---------------------------------------------------------


@pytest.fixture
def keyed_server(tmp_path):
    engine = ScriptedEngine()
    with LiveServer(make_app(lambda: engine, tmp_path / "r.db", api_key="sesame"), api_key="sesame") as live:
        live.http = httpx.Client(base_url=live.url, headers={"Authorization": "Bearer sesame"}, timeout=60)
        yield live


def test_both_prefixes_share_routes_auth_and_store(keyed_server):
    server, http, engine = keyed_server, keyed_server.http, keyed_server.engine
    # The same key check, over HTTP and at the WebSocket handshake.
    r = httpx.post(f"{server.url}{SPEC}/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    import websockets

    with pytest.raises(websockets.InvalidStatus) as refused:
        connect(ws_url(server, SPEC)).close()
    assert refused.value.response.status_code == 401
    with connect(ws_url(server, SPEC), additional_headers={"Authorization": "Bearer sesame"}) as socket:
        assert ws_turn(socket, {"type": "response.create", "model": MODEL, "input": "Hi"})[-1]["type"] == (
            "response.completed"
        )
    # The same JSON-only guard.
    r = http.post(f"{SPEC}/responses", content=b"model=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_type"

    # One store: made on one prefix, read, listed and deleted on the other.
    made = http.post(f"{SPEC}/responses", json={"model": MODEL, "input": "Hello"}).json()
    assert http.get(f"/v1/responses/{made['id']}").json()["output"] == made["output"]
    assert http.get(f"/v1/responses/{made['id']}/input_items").json()["data"][0]["content"][0]["text"] == "Hello"
    again = http.post("/v1/responses", json={"model": MODEL, "input": "More", "previous_response_id": made["id"]})
    assert http.get(f"{SPEC}/responses/{again.json()['id']}").json()["previous_response_id"] == made["id"]
    assert http.post(f"{SPEC}/responses/input_tokens", json={"model": MODEL, "input": "Hi"}).json()["input_tokens"] > 0
    assert http.delete(f"{SPEC}/responses/{made['id']}").json()["deleted"] is True
    assert http.get(f"/v1/responses/{made['id']}").status_code == 404

    # Only the Responses API is there.
    for path in ("/chat/completions", "/conversations", "/models"):
        r = http.post(f"{SPEC}{path}", json={}) if path != "/models" else http.get(f"{SPEC}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path

    # A background response made on /v1 streams in the spec's dialect on its prefix: live, then stored.
    engine.token_delay = 0.005
    engine.say(REASONED.replace("A short answer will do.", "Think " * 30))
    queued = http.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True}).json()
    with http.stream("GET", f"{SPEC}/responses/{queued['id']}", params={"stream": "true"}) as live:
        events = parse_sse(live.read())[0]
    wait_for(lambda: http.get(f"/v1/responses/{queued['id']}").json()["status"] == "completed")
    stored = parse_sse(http.get(f"{SPEC}/responses/{queued['id']}", params={"stream": "true"}).content)[0]
    openai = parse_sse(http.get(f"/v1/responses/{queued['id']}", params={"stream": "true"}).content)[0]
    for stream in (events, stored):
        assert [p for e in stream for p in spec_problems(e)] == []
        assert "response.reasoning.delta" in [e["type"] for e in stream]
    assert [e["type"] for e in stored] == [renamed(e["type"]) for e in openai]
    assert "response.reasoning_text.delta" in [e["type"] for e in openai]

    metrics = http.get("/metrics").text
    assert 'endpoint="/openresponses/v1/responses"' in metrics
