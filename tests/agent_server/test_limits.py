"""Request limits and validation errors: each gets a precise 4xx with an OpenAI-style body.

Body size, items in `input` / `messages`, tools, prompts longer than the context, output limits
that cannot fit, parameters this server does not support, unknown parameters, JSON that is
malformed, too deep, holds lone surrogates, NaN or huge integers, and pydantic validation errors
mapped to `{"error": {"message", "type", "param", "code"}}` naming the parameter. Run on the
scripted engine and on the real engine with the tiny model (same context length).
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from agent_server.chat.routes import UNSUPPORTED as CHAT_UNSUPPORTED
from agent_server.responses.routes import UNSUPPORTED as RESPONSES_UNSUPPORTED
from agent_server.tokenization_cost import fit_tokenization_budget, tokenization_cost
from tests.conftest import MODEL, LiveServer, build_tiny_engine, make_app
from tests.fake_engine import ScriptedEngine

MAX_BYTES = 64 << 10
MAX_ITEMS = 8
MAX_TOOLS = 4
CONTEXT = 1024  # the tiny engine's max_model_len (conftest), and the scripted one's here
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module", params=["fake", "tiny"])
def server(request, tmp_path_factory):
    if request.param == "fake":
        engine = ScriptedEngine(max_model_len=CONTEXT)
    else:
        engine = build_tiny_engine(request.getfixturevalue("tiny_checkpoint"))
    app = make_app(
        lambda: engine,
        tmp_path_factory.mktemp("limits") / "r.db",
        max_request_bytes=MAX_BYTES,
        max_input_items=MAX_ITEMS,
        max_tools=MAX_TOOLS,
    )
    with LiveServer(app, kind=request.param) as live:
        live.http = httpx.Client(base_url=live.url, timeout=120, headers={"Content-Type": "application/json"})
        assert live.engine.max_model_len == CONTEXT
        yield live
        live.http.close()


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:400])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


def respond(server, **body) -> httpx.Response:
    return server.http.post("/v1/responses", json={"model": MODEL, **body})


def chat(server, **body) -> httpx.Response:
    return server.http.post("/v1/chat/completions", json={"model": MODEL, **body})


# --- size and counts ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
def test_body_size_limit(server, path):
    big = json.dumps({"model": MODEL, "input": "x" * MAX_BYTES}).encode()
    error = error_of(server.http.post(path, content=big), 413)
    assert error["code"] == "request_too_large" and str(MAX_BYTES) in error["message"]

    # Without a Content-Length (chunked upload) the limit holds as the body streams in.
    def chunks():
        for _ in range(64):
            yield b"x" * 4096

    error = error_of(server.http.post(path, content=chunks()), 413)
    assert error["code"] == "request_too_large"
    # A body just under the limit is read (and judged on its content).
    small = json.dumps({"model": MODEL, "instructions": "y" * (MAX_BYTES - 200)}).encode()
    assert len(small) <= MAX_BYTES
    assert server.http.post(path, content=small).status_code != 413


def test_number_of_input_items(server):
    error = error_of(respond(server, input=[USER] * (MAX_ITEMS + 1), max_output_tokens=4))
    assert error["param"] == "input" and error["code"] == "array_above_max_length"
    assert str(MAX_ITEMS) in error["message"] and str(MAX_ITEMS + 1) in error["message"]
    assert respond(server, input=[USER] * MAX_ITEMS, max_output_tokens=4).status_code == 200

    error = error_of(chat(server, messages=[USER] * (MAX_ITEMS + 1), max_tokens=4))
    assert error["param"] == "messages" and error["code"] == "array_above_max_length"
    assert chat(server, messages=[USER] * MAX_ITEMS, max_tokens=4).status_code == 200


def test_number_of_tools(server):
    tools = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(MAX_TOOLS + 1)]
    error = error_of(respond(server, input="hi", tools=tools))
    assert error["param"] == "tools" and error["code"] == "array_above_max_length"
    chat_tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    error = error_of(chat(server, messages=[USER], tools=chat_tools))
    assert error["param"] == "tools" and error["code"] == "array_above_max_length"


# --- the context ----------------------------------------------------------------------------


def test_prompt_longer_than_the_context(server):
    long_text = "lorem ipsum " * CONTEXT
    error = error_of(respond(server, input=long_text))
    assert error["param"] == "input" and error["code"] == "context_length_exceeded"
    assert str(CONTEXT) in error["message"]
    error = error_of(chat(server, messages=[{"role": "user", "content": long_text}]))
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


def test_output_limit_beyond_what_fits(server):
    error = error_of(respond(server, input="hi", max_output_tokens=CONTEXT))
    assert error["param"] == "max_output_tokens" and error["code"] == "context_length_exceeded"
    room = int(error["message"].split("at most ")[1].split()[0])
    assert 0 < room < CONTEXT and f"got {CONTEXT}" in error["message"]
    error = error_of(respond(server, input="hi", max_output_tokens=room + 1))
    assert error["param"] == "max_output_tokens"
    # The largest limit that fits is accepted (generation stops early on the scripted engine;
    # the real one is asked to stop at once via a short second request below).
    if server.kind == "fake":
        assert respond(server, input="hi", max_output_tokens=room).status_code == 200
    assert respond(server, input="hi", max_output_tokens=3).json()["status"] in ("completed", "incomplete")

    for param in ("max_tokens", "max_completion_tokens"):
        error = error_of(chat(server, messages=[USER], **{param: CONTEXT}))
        assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert chat(server, messages=[USER], max_tokens=3).json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_longest_token_bounds_the_cheap_check():
    # A conversation of C characters is at least C / MAX_TOKEN_BYTES tokens only if no token is
    # longer: the vocabulary's longest.
    from agent_server.large_prompts import MAX_TOKEN_BYTES
    from agent_server.token_bytes import _vocabulary

    assert max(len(b) for b in _vocabulary().values()) == MAX_TOKEN_BYTES


def request_in_the_background(url: str, path: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def send():
        started = time.monotonic()
        result["response"] = httpx.post(url + path, json=body, timeout=300)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


def health_latencies_while(url: str, thread: threading.Thread) -> list[float]:
    """Times /health takes to answer, polled until `thread` ends."""
    latencies = []
    with httpx.Client(timeout=60) as client:
        while thread.is_alive():
            started = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    return latencies


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_a_prompt_far_over_the_context_is_refused_without_tokenizing(tmp_path, api):
    # 8 MB of words would take the tokenizer seconds, on the event loop; at most 128 bytes a
    # token, it cannot fit 1024 tokens, which its length says at once.
    app = make_app(lambda: ScriptedEngine(max_model_len=CONTEXT), tmp_path / "r.db", max_request_bytes=16 << 20)
    text = "word " * ((8 << 20) // 5)
    message = {"role": "user", "content": text}
    path, body = (
        ("/v1/responses", {"model": MODEL, "input": [message]})
        if api == "responses"
        else ("/v1/chat/completions", {"model": MODEL, "messages": [message]})
    )
    with LiveServer(app) as live:
        thread, result = request_in_the_background(live.url, path, body)
        latencies = health_latencies_while(live.url, thread)
        thread.join()
    assert max(latencies, default=0) < 0.5, sorted(latencies)[-3:]
    error = error_of(result["response"])
    assert error["code"] == "context_length_exceeded" and error["param"] == (
        "input" if api == "responses" else "messages"
    )
    assert f"at least {len(text) // 128} tokens" in error["message"] and str(CONTEXT) in error["message"]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "instructions", "chat"])
def test_a_long_prompt_that_may_fit_is_tokenized_off_the_event_loop(tmp_path, api):
    # 2.5 MB of words (625,000 tokens) fits a context of 2M tokens: it is tokenized, taking a
    # second or more, and other clients are answered meanwhile.
    engine = ScriptedEngine(max_model_len=2_000_000)
    app = make_app(lambda: engine, tmp_path / "r.db", max_request_bytes=16 << 20)
    text = "word " * 500_000
    path, body = {
        "responses": ("/v1/responses", {"model": MODEL, "input": text}),
        "instructions": ("/v1/responses", {"model": MODEL, "input": "hi", "instructions": text}),
        "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
    }[api]
    with LiveServer(app) as live:
        # (the first long prompt starts the worker process: not what is measured; the second is
        # another text, as rendered instructions are kept for the next request that has them)
        assert (
            httpx.post(
                live.url + path, json=json.loads(json.dumps(body).replace("word", "wort")), timeout=300
            ).status_code
            == 200
        )
        thread, result = request_in_the_background(live.url, path, body)
        latencies = health_latencies_while(live.url, thread)
        thread.join()
    assert result["response"].status_code == 200, result["response"].text[:300]
    assert max(latencies) < 0.5, sorted(latencies)[-3:]  # the loop kept answering...
    assert len(latencies) >= 5, (latencies, result["seconds"])  # ...while the request took a while
    assert len(engine.calls[-1].request.prompt_token_ids) > 500_000  # the whole prompt, as the loop would render it
    # The same tokens the event loop renders for it.
    from agent_server.chat.prompt import chat_messages
    from agent_server.harmony import render_prompt
    from schemas.chat import ChatCompletionRequest

    if api == "chat":
        expected = render_prompt(chat_messages(ChatCompletionRequest.model_validate(body)))
        assert engine.calls[-1].request.prompt_token_ids == expected


# --- parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RESPONSES_UNSUPPORTED))
def test_unsupported_responses_parameters_are_named(server, name):
    error = error_of(respond(server, input="hi", **{name: "x"}))
    assert error["param"] == name and error["code"] == "unsupported_parameter"
    assert f"'{name}'" in error["message"] and RESPONSES_UNSUPPORTED[name] in error["message"]


@pytest.mark.parametrize("name", sorted(CHAT_UNSUPPORTED))
def test_unsupported_chat_parameters_are_named(server, name):
    error = error_of(chat(server, messages=[USER], **{name: {}}))
    assert error["param"] == name and error["code"] == "unsupported_parameter"
    assert CHAT_UNSUPPORTED[name] in error["message"]


# (request body, param, code) for the Responses API, then for Chat Completions.
RESPONSES_INVALID = [
    ({"input": "hi", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"input": [{"role": "user", "content": "hi", "mood": "x"}]}, "input[0].mood", "unknown_parameter"),
    ({"input": "hi", "reasoning": {"effort": "low", "depth": 3}}, "reasoning.depth", "unknown_parameter"),
    ({"input": "hi", "model": None}, "model", "invalid_type"),
    ({"input": "hi", "temperature": "hot"}, "temperature", "invalid_type"),
    ({"input": "hi", "temperature": 2.5}, "temperature", "invalid_value"),
    ({"input": "hi", "top_p": 0}, "top_p", "invalid_value"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "max_output_tokens": "10"}, "max_output_tokens", "invalid_type"),
    ({"input": "hi", "stream": "yes"}, "stream", "invalid_type"),
    ({"input": [USER, {"role": "user", "content": 5}]}, "input[1].content", "invalid_type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "invalid_value"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
        "unsupported_value",
    ),
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        "missing_required_parameter",
    ),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "invalid_value"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools[0]", "unsupported_value"),
    (
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        "text.format.schema",
        "invalid_value",
    ),
    (
        {
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": 5}}],
        },
        "tools[0].parameters",
        "invalid_value",
    ),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "object_above_max_properties"),
    ({"input": "hi", "include": ["everything"]}, "include[0]", "invalid_value"),
    # Our own output items sent back: the fields the server replays are typed.
    ({"input": [{"type": "code_interpreter_call", "id": "c", "code": 5}]}, "input[0].code", "invalid_type"),
    (
        {
            "input": [
                {"type": "code_interpreter_call", "id": "c", "code": "x", "outputs": [{"type": "logs", "logs": 5}]}
            ]
        },
        "input[0].outputs[0].logs",
        "invalid_type",
    ),
    (
        {
            "input": [
                {"type": "mcp_call", "id": "m", "name": "n", "server_label": "x", "arguments": "{}", "output": {"a": 1}}
            ]
        },
        "input[0].output",
        "invalid_type",
    ),
    (
        {"input": [{"type": "mcp_call", "id": "m", "name": "n", "server_label": "x", "arguments": {"a": 1}}]},
        "input[0].arguments",
        "invalid_type",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c1", "name": "", "arguments": "{}"}]},
        "input[0].name",
        "invalid_value",
    ),
    ({}, "input", "missing_required_parameter"),
]
CHAT_INVALID = [
    ({"messages": [USER], "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [USER], "n": 0}, "n", "invalid_value"),
    ({"messages": [USER], "n": 1.5}, "n", "invalid_type"),
    ({"messages": [USER], "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"messages": [USER], "logit_bias": {"hello": 1}}, "logit_bias", "invalid_value"),
    ({"messages": [USER], "logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"messages": [USER], "logit_bias": {"\u00b2": 1}}, "logit_bias", "invalid_value"),  # a digit to isdigit()
    ({"messages": [USER], "logit_bias": {"\uff11": 1}}, "logit_bias", "invalid_value"),  # a full-width 1
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", None),
    ({"messages": [USER], "top_logprobs": 3}, "top_logprobs", None),
    ({"messages": [USER], "top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages[0].extra", "unknown_parameter"),
    (
        {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
        "tools[0].function.parameters",
        "invalid_type",
    ),
    (
        {
            "messages": [USER],
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "city"}}}
            ],
        },
        "tools[0].function.parameters",
        "invalid_value",
    ),
]


# Strings the server echoes back and stores, with OpenAI's limits and words: (field, value, param,
# code, message).
ECHOED_TOO_LONG = [
    (
        "user",
        "u" * 65,
        "user",
        "string_above_max_length",
        "Invalid 'user': string too long. Expected a string with maximum length 64, but got a string with length 65 "
        "instead.",
    ),
    (
        "safety_identifier",
        "s" * 1000,
        "safety_identifier",
        "string_above_max_length",
        "Invalid 'safety_identifier': string too long. Expected a string with maximum length 64, but got a string with "
        "length 1000 instead.",
    ),
    (
        "prompt_cache_key",
        "é" * 65,
        "prompt_cache_key",
        "string_above_max_length",
        "Invalid 'prompt_cache_key': string too long. Expected a string with maximum length 64, but got a string with "
        "length 65 instead.",
    ),
    (
        "metadata",
        {f"k{i}": "v" for i in range(17)},
        "metadata",
        "object_above_max_properties",
        "Invalid 'metadata': too many properties. Expected an object with at most 16 properties, but got an object "
        "with 17 properties instead.",
    ),
    (
        "metadata",
        {"a.b" + "k" * 62: "v"},
        "metadata.a.b" + "k" * 62,
        "property_name_above_max_length",
        "Invalid property name in 'metadata': 'a.b" + "k" * 62 + "' is too long. Expected a string with maximum length "
        "64, but got a string with length 65 instead.",
    ),
    (
        "metadata",
        {"topic": "x" * 513},
        "metadata.topic",
        "string_above_max_length",
        "Invalid 'metadata.topic': string too long. Expected a string with maximum length 512, but got a string with "
        "length 513 instead.",
    ),
]


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("field,value,param,code,message", ECHOED_TOO_LONG)
def test_echoed_strings_have_openais_limits(server, api, field, value, param, code, message):
    send = respond if api == "responses" else chat
    base = {"input": "hi"} if api == "responses" else {"messages": [USER]}
    error = error_of(send(server, **base, **{field: value}))
    assert (error["param"], error["code"], error["message"]) == (param, code, message)


def test_echoed_strings_at_their_limits_are_echoed(fake_server):
    limits = {
        "user": "u" * 64,
        "safety_identifier": "s" * 64,
        "prompt_cache_key": "p" * 64,
        "metadata": {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)},
    }
    r = httpx.post(f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "hi", **limits})
    assert r.status_code == 200, r.text[:300]
    assert {k: r.json()[k] for k in limits} == limits
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json={"model": MODEL, "messages": [USER], **limits})
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("body,param,code", RESPONSES_INVALID)
def test_responses_validation_errors_name_the_parameter(server, body, param, code):
    error = error_of(server.http.post("/v1/responses", json={"model": MODEL, **body}))
    assert (error["param"], error["code"]) == (param, code), error["message"]


@pytest.mark.parametrize("body,param,code", CHAT_INVALID)
def test_chat_validation_errors_name_the_parameter(server, body, param, code):
    error = error_of(server.http.post("/v1/chat/completions", json={"model": MODEL, **body}))
    assert (error["param"], error["code"]) == (param, code), error["message"]


def test_fields_the_sdk_response_rejects_are_a_400(fake_server):
    # The SDK's Response type (which the response is built on) wants a container {"type": "auto",
    # ...}; the request schema types it the same way, so the error names the field it is about
    # (test_hardening_tool_shapes goes through every tool field).
    r = httpx.post(
        f"{fake_server.url}/v1/responses",
        json={"model": MODEL, "input": "hi", "tools": [{"type": "code_interpreter", "container": {"kind": "big"}}]},
    )
    error = error_of(r)
    assert (error["param"], error["code"]) == ("tools[0].container.kind", "unknown_parameter")


def test_missing_model_and_unknown_model(server):
    error = error_of(server.http.post("/v1/responses", json={"input": "hi"}))
    assert (error["param"], error["code"]) == ("model", "missing_required_parameter")
    error = error_of(respond(server, input="hi", model="gpt-9"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")


# --- JSON itself ----------------------------------------------------------------------------

BAD_JSON = [
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
    (b'"just a string"', None),
    (b'{"model": "m", "input": "\xff\xfe"}', None),  # not UTF-8
    (b'{"model": "m", "temperature": NaN}', None),
    (b'{"model": "m", "temperature": -Infinity}', None),
    (b'{"model": "m", "input": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", None),  # deeper than the parser goes
    (b'{"model": "m", "input": ' + b"[" * 150 + b"]" * 150 + b"}", "input"),  # deeper than allowed
    (b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", None),  # more digits than Python converts
]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
@pytest.mark.parametrize("raw,param", BAD_JSON, ids=lambda v: repr(v)[:30] if isinstance(v, bytes) else str(v))
def test_malformed_json(server, path, raw, param):
    error = error_of(server.http.post(path, content=raw))
    assert error["code"] == "invalid_json" and error["param"] == param


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"model": "m", "input": "a\\ud800b"}', "input"),  # a lone surrogate escape
        (b'{"model": "m", "input": [{"role": "user", "content": "\\udfff"}]}', "input[0].content"),
        (b'{"model": "m", "input": "\xed\xa0\x80"}', "input"),  # a surrogate encoded as bytes (CESU-8)
        (b'{"model": "m", "metadata": {"\\ud83d": "x"}}', "metadata"),  # in a key
    ],
)
def test_unpaired_surrogates_are_invalid_unicode(server, raw, param):
    error = error_of(server.http.post("/v1/responses", content=raw))
    assert error["code"] == "invalid_value" and error["param"] == param and "Unicode" in error["message"]
    # A proper pair (an emoji written as two escapes) is fine.
    r = server.http.post(
        "/v1/responses", content=b'{"model": "%s", "input": "\\ud83d\\ude00", "max_output_tokens": 3}' % MODEL.encode()
    )
    assert r.status_code == 200


def test_integers_beyond_64_bits(server):
    error = error_of(chat(server, messages=[USER], seed=2**64))
    assert error["param"] == "seed" and error["code"] == "invalid_value"
    error = error_of(respond(server, input="hi", max_output_tokens=-(2**63) - 1))
    assert error["param"] == "max_output_tokens"
    # The extremes of the range are accepted where a parameter takes any integer.
    for seed in (2**63 - 1, -(2**63)):
        r = chat(server, messages=[USER], seed=seed, n=2, temperature=1.0, max_tokens=2)
        assert r.status_code == 200, r.text


def test_query_parameters_are_checked(server):
    rid = respond(server, input="hi", max_output_tokens=3).json()["id"]
    for query, param in (
        ({"limit": "0"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"limit": "9" * 5000}, "limit"),
        ({"order": "sideways"}, "order"),
        ({"after": "item_nope"}, "after"),
    ):
        error = error_of(server.http.get(f"/v1/responses/{rid}/input_items", params=query))
        assert error["param"] == param
    error = error_of(server.http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "x"}))
    assert error["param"] == "starting_after"
    error_of(server.http.get("/v1/responses/resp_missing"), 404)


@pytest.mark.parametrize(
    "path,raw,param",
    [
        (
            "/v1/responses",
            b'{"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", '
            b'"parameters": {"type": "object", "x": 1e400}}]}',
            "tools[0].parameters.x",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"maximum": -1e999}}}}',
            "response_format.json_schema.schema.maximum",
        ),
    ],
)
def test_numbers_beyond_the_float_range(server, path, raw, param):
    # json.loads reads 1e400 as infinity, which no JSON can carry on to the prompt.
    error = error_of(server.http.post(path, content=raw))
    assert (error["param"], error["code"]) == (param, "invalid_value")


# --- text that would take long to tokenize -------------------------------------------------


def test_tokenization_cost_counts_long_runs():
    assert tokenization_cost("a" * 31) == 0 and tokenization_cost("ab cd " * 100) == 0
    assert tokenization_cost("a" * 40) == tokenization_cost("_" * 40) == tokenization_cost(" \n" * 20) == 1600
    assert tokenization_cost("\u00e9" * 40) == 80**2  # UTF-8 bytes
    # Combining marks join letter runs, as the tokenizer's letter pieces hold them (Thai vowel
    # signs, decomposed accents).
    assert tokenization_cost("\u0e01\u0e34" * 20) == 120**2 and tokenization_cost("e\u0301" * 20) == 60**2
    assert tokenization_cost("a" * 40 + "1" + "-" * 50 + "b" * 40) == 40**2 + 50**2 + 40**2
    # The ASCII path (class letters searched as bytes) agrees with the regex over the same runs:
    # a digit and a non-ASCII letter at the end send the same text down the regex path.
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("aZ_-. \n\t7") * rng.randint(1, 50) for _ in range(rng.randint(0, 8)))
        assert tokenization_cost(text) == tokenization_cost(text + "7\u00e9"), repr(text)


def test_text_over_the_budget_is_cut_before_the_run_that_crosses_it():
    text = "a b " + "x" * 100 + " c " + "y" * 100 + " d"
    assert fit_tokenization_budget(text, budget=2 * 100**2) == text
    cut = fit_tokenization_budget(text, budget=100**2 + 50**2)
    assert (
        cut == "a b " + "x" * 100 + " c \n[... 102 characters left out: a run of 100 characters with no word "
        "boundary is too long to tokenize]"
    )


def test_text_that_would_tokenize_slowly_is_refused(server):
    # One run of 30,000 letters would take about 0.4 s of tokenizing, with the server held up.
    error = error_of(respond(server, input="x" * 30_000))
    assert (error["param"], error["code"]) == ("input", "invalid_value") and "runs" in error["message"]
    error = error_of(chat(server, messages=[{"role": "user", "content": "-" * 30_000}]))
    assert error["param"] == "messages[0].content"
    error = error_of(respond(server, input="\u0e01\u0e34" * 5_000))  # 30 KB of Thai letters and vowel signs
    assert error["param"] == "input"
    # Keys reach the prompt too: a function's parameter names.
    error = error_of(
        respond(
            server,
            input="hi",
            tools=[
                {
                    "type": "function",
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"p" * 30_000: {"type": "string"}}},
                }
            ],
        )
    )
    assert error["param"] == "tools[0].parameters.properties"
    # Several shorter runs count together.
    error = error_of(respond(server, input=[{"role": "user", "content": "y" * 15_000}] * 3))
    assert error["code"] == "invalid_value" and error["param"].startswith("input[")
    # A run within the limit, and ordinary text of any length, reach the prompt (and its limit).
    for text in ("x" * 20_000, "word " * 8_000):
        assert error_of(respond(server, input=text))["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_a_requests_schemas_together_are_bounded(fake_server):
    # Each schema is under 64 KB, but 5 tools of 60 KB would be more than 0.8 s of jsonschema.
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "d" * 30} for i in range(800)},
    }
    tools = [{"type": "function", "name": f"f{i}", "parameters": schema} for i in range(5)]
    r = httpx.post(
        f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "hi", "tools": tools}, timeout=60
    )  # (seconds of jsonschema on a busy machine: more than httpx's default 5)
    error = error_of(r)
    assert (error["param"], error["code"]) == ("tools[4].parameters", "invalid_value") and "in all" in error["message"]
    r = httpx.post(
        f"{fake_server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [USER],
            "tools": [{"type": "function", "function": {"name": t["name"], "parameters": schema}} for t in tools[:4]],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
        timeout=60,
    )
    assert error_of(r)["param"] == "response_format.json_schema.schema"
    # Four of them pass the schema checks (and reach the prompt, which they overfill).
    r = httpx.post(
        f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "hi", "tools": tools[:4]}, timeout=60
    )
    assert error_of(r)["code"] == "context_length_exceeded"


def test_response_schemas_over_64_kb_are_refused(fake_server):
    # jsonschema checks a schema against its meta-schema at about 0.4 MB a second, holding the server.
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "d" * 30} for i in range(1200)},
    }
    r = httpx.post(
        f"{fake_server.url}/v1/responses",
        json={
            "model": MODEL,
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
        },
    )
    error = error_of(r)
    assert (error["param"], error["code"]) == ("text.format.schema", "invalid_value") and "bytes" in error["message"]
    r = httpx.post(
        f"{fake_server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [USER],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
    )
    assert error_of(r)["param"] == "response_format.json_schema.schema"
