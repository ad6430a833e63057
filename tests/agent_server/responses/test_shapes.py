"""What the server sends has OpenAI's shapes: every response and every streamed event
validates as the SDK's own pydantic type in strict mode, carries the fields OpenAI's carry
(null where unset), and SSE lines end in "\\n". Strict clients (the Agents SDKs, Codex, the
OpenResponses suite) check these.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.agent_server.responses.test_routes import WEATHER_CALL, WEATHER_TOOL
from tests.conftest import MODEL

EVENT = TypeAdapter(ResponseStreamEvent)
ANSWER = "<|channel|>analysis<|message|>Greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>"
# Fields OpenAI's response objects always carry, null or not.
RESPONSE_FIELDS = {
    "id",
    "object",
    "created_at",
    "completed_at",
    "status",
    "background",
    "error",
    "incomplete_details",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "model",
    "output",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "store",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
    "usage",
    "user",
    "metadata",
    "frequency_penalty",
    "presence_penalty",
}


def sse_events(raw: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of a raw SSE body whose lines end in "\\n"."""
    assert "\r" not in raw
    events = []
    for block in raw.split("\n\n"):
        lines = block.split("\n")
        data = [line[6:] for line in lines if line.startswith("data: ")]
        if data:
            name = next((line[7:] for line in lines if line.startswith("event: ")), None)
            events.append((name, "\n".join(data)))
    return events


def check_response(data: dict) -> Response:
    missing = RESPONSE_FIELDS - set(data)
    assert not missing, f"missing: {missing}"
    assert isinstance(data["created_at"], int)
    assert data["completed_at"] is None or isinstance(data["completed_at"], int)
    assert set(data["reasoning"]) >= {"effort", "summary"} and "verbosity" in data["text"]
    return Response.model_validate(data, strict=True)


BODY = {
    "model": MODEL,
    "input": "Hi",
    "tools": [WEATHER_TOOL],
    "metadata": {"k": "v"},
    "reasoning": {"effort": "low", "summary": "auto"},
    "text": {"verbosity": "low"},
    "top_logprobs": 0,
    "prompt_cache_key": "conv-1",
    "prompt_cache_retention": "24h",
    "store": True,
}


def test_a_response_is_openais_shape(live_server):
    if live_server.kind == "fake":
        live_server.engine.say(ANSWER)
    r = httpx.post(f"{live_server.url}/v1/responses", json={**BODY, "max_output_tokens": 16}, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    response = check_response(data)
    assert response.status in ("completed", "incomplete") and isinstance(data["completed_at"], (int, type(None)))
    assert data["store"] is True and data["top_logprobs"] == 0 and data["prompt_cache_retention"] == "24h"
    assert data["reasoning"] == {"effort": "low", "summary": "auto"} and data["text"]["verbosity"] == "low"
    tool = data["tools"][0]
    assert tool["strict"] is None and tool["name"] == "get_weather"  # echoed with strict, null where unset
    if response.status == "completed":
        assert isinstance(data["completed_at"], int)
    # The stored copy is the same shape.
    check_response(httpx.get(f"{live_server.url}/v1/responses/{data['id']}").json())


@pytest.mark.parametrize("background", [False, True])
def test_every_streamed_event_is_an_sdk_event_in_strict_mode(fake_server, background):
    fake_server.engine.say("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + WEATHER_CALL)
    body = {**BODY, "stream": True, "background": background}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{fake_server.url}/v1/responses", json=body) as r:
            raw = r.read().decode()
    events = sse_events(raw)
    assert events and all(name is not None for name, _ in events)
    for name, payload in events:
        data = json.loads(payload)
        assert data["type"] == name
        EVENT.validate_python(data, strict=True)
        if "response" in data:
            check_response(data["response"])
    final = json.loads(events[-1][1])
    assert final["type"] == "response.completed"
    # What gpt-oss's compatibility test checks: the reasoning streams as reasoning_text events,
    # and the reasoning item holds it as reasoning_text content.
    names = {name for name, _ in events}
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= names
    reasoning = final["response"]["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "Need the weather."}
    ]


def test_stateless_reasoning_events_validate_too(fake_server):
    fake_server.engine.say(ANSWER)
    body = {**BODY, "stream": True, "store": False, "include": ["reasoning.encrypted_content"]}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{fake_server.url}/v1/responses", json=body) as r:
            raw = r.read().decode()
    items = []
    for _, payload in sse_events(raw):
        event = EVENT.validate_python(json.loads(payload), strict=True)
        if event.type == "response.output_item.done":
            items.append(event.item)
    assert items[0].type == "reasoning" and items[0].encrypted_content
    assert json.loads(sse_events(raw)[-1][1])["response"]["store"] is False


def test_chat_completion_and_chunks_are_sdk_types_in_strict_mode(fake_server):
    fake_server.engine.say(ANSWER, ANSWER)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "verbosity": "low",
        "reasoning_effort": "minimal",
    }
    data = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body, timeout=60).json()
    completion = ChatCompletion.model_validate(data, strict=True)
    message = data["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Greeting." and completion.choices[0]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{fake_server.url}/v1/chat/completions", json={**body, "stream": True}) as r:
            raw = r.read().decode()
    events = sse_events(raw)
    assert events[-1][1] == "[DONE]"
    reasoning = ""
    for _, payload in events[:-1]:
        chunk = json.loads(payload)
        ChatCompletionChunk.model_validate(chunk, strict=True)
        for choice in chunk["choices"]:
            reasoning += choice["delta"].get("reasoning") or ""
    assert reasoning == "Greeting."
    prompt = fake_server.engine.calls[-1].request.prompt_token_ids
    text = __import__("inference.tokenizer", fromlist=["harmony_encoding"]).harmony_encoding().decode(prompt)
    assert "Reasoning: low" in text and "Keep your final answer short" in text


def test_messages_the_sdks_parse_returned_go_back_as_they_are(fake_server):
    """`.parse()` adds `parsed` to the message and `parsed_arguments` to its tool calls."""
    import pydantic

    class Weather(pydantic.BaseModel):
        city: str

    engine, client = fake_server.engine, fake_server.client()
    engine.say(
        "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.Weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    import openai

    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Paris?"}], tools=[openai.pydantic_function_tool(Weather)]
    )
    message = parsed.choices[0].message
    assert message.tool_calls[0].function.parsed_arguments == Weather(city="Paris")
    engine.say(ANSWER)
    again = client.chat.completions.create(
        model=MODEL,
        tools=[openai.pydantic_function_tool(Weather)],
        messages=[
            {"role": "user", "content": "Paris?"},
            message.model_dump(),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
        ],
    )
    assert again.choices[0].message.content == "Hi!"


def test_answer_logprobs_when_included(live_server):
    """include message.output_text.logprobs: each answer token with `top_logprobs` alternatives,
    on the output text and its delta and done events; the tokens spell the text."""
    if live_server.kind == "fake":
        live_server.engine.say(ANSWER)
    body = {
        "model": MODEL,
        "input": "Hi",
        "max_output_tokens": 24,
        "top_logprobs": 2,
        "stream": True,
        "include": ["message.output_text.logprobs"],
    }
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{live_server.url}/v1/responses", json=body) as r:
            raw = r.read().decode()
    events = [EVENT.validate_python(json.loads(payload), strict=True) for _, payload in sse_events(raw)]
    final = events[-1].response
    texts = [part for item in final.output if item.type == "message" for part in item.content]
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    if live_server.kind == "fake":
        assert [p.text for p in texts] == ["Hi!"]
    for part in texts:
        spelled = b"".join(bytes(lp.bytes) for lp in part.logprobs).decode("utf-8", errors="replace")
        if live_server.kind == "fake":
            assert spelled == part.text
        else:  # random weights: a text that never became Harmony (a header cut off) has no entries
            assert spelled in part.text
        assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert [lp.token for p in texts for lp in p.logprobs] == [lp.token for lp in streamed]
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for e in done for lp in e.logprobs] == [lp.token for p in texts for lp in p.logprobs]
    # Without the include, none.
    if live_server.kind == "fake":
        live_server.engine.say(ANSWER)
        data = httpx.post(f"{live_server.url}/v1/responses", json={"model": MODEL, "input": "Hi"}, timeout=60).json()
        assert data["output"][-1]["content"][0]["logprobs"] == []
        assert live_server.engine.calls[-1].request.sampling.logprobs is None
