"""Chat Completions against a live server with the official `openai` client, streaming and not."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from inference.tokenizer import harmony_encoding
from tests.conftest import MODEL, wait_for
from tests.fake_engine import harmony_tokens

REASONED = (
    "<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Hello, world!<|return|>"
)
ONE_CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
TWO_CALLS = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    "<|end|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
    '{"zone": "CET"}<|call|>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    },
]
HELLO = [{"role": "user", "content": "Say hello."}]


def prompt_text(engine, index=-1) -> str:
    return harmony_encoding().decode(engine.calls[index].request.prompt_token_ids)


def collect(stream):
    """A chat stream folded into per-choice text, reasoning, tool calls and finish reasons."""
    chunks = list(stream)
    choices: dict[int, dict] = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            acc = choices.setdefault(
                c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None, "logprobs": []}
            )
            acc["content"] += c.delta.content or ""
            acc["reasoning"] += getattr(c.delta, "reasoning", None) or ""
            assert getattr(c.delta, "reasoning", None) == getattr(c.delta, "reasoning_content", None)
            for call in c.delta.tool_calls or []:
                slot = acc["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function.name:
                    slot["name"] = call.function.name
                slot["arguments"] += call.function.arguments or ""
            if c.logprobs and c.logprobs.content:
                acc["logprobs"] += c.logprobs.content
            if c.finish_reason:
                acc["finish"] = c.finish_reason
    return chunks, choices


def test_plain_text_with_reasoning(live_server):
    client = live_server.client()
    if live_server.kind == "fake":
        live_server.engine.say(REASONED)
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=24, temperature=0, reasoning_effort="high"
    )
    assert completion.object == "chat.completion" and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    usage = completion.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.completion_tokens <= 24
    if live_server.kind == "tiny":
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
        return
    assert choice.message.content == "Hello, world!" and choice.finish_reason == "stop"
    assert choice.message.reasoning == choice.message.reasoning_content == "Simple greeting."
    assert usage.completion_tokens == len(harmony_tokens(REASONED))
    assert usage.completion_tokens_details.reasoning_tokens == len(
        harmony_tokens("<|channel|>analysis<|message|>Simple greeting.<|end|>")
    )
    assert "Reasoning: high" in prompt_text(live_server.engine)


def test_streaming_text_and_usage_chunk(live_server):
    client = live_server.client()
    if live_server.kind == "fake":
        live_server.engine.say(REASONED)
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks, choices = collect(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    if live_server.kind == "tiny":
        assert choices[0]["finish"] in ("stop", "length")
        return
    assert choices[0]["content"] == "Hello, world!" and choices[0]["reasoning"] == "Simple greeting."
    assert choices[0]["finish"] == "stop"


def test_one_tool_call_and_its_result(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say(ONE_CALL)
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    assert "type get_time = (_: {\nzone?: string,\n}) => any;" in prompt_text(engine)

    engine.say("<|channel|>final<|message|>Sunny.<|return|>")
    follow = client.chat.completions.create(
        model=MODEL,
        tools=TOOLS,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Need weather.",
                "tool_calls": [call.model_dump(exclude_none=True)],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
        ],
    )
    assert follow.choices[0].message.content == "Sunny."
    text = prompt_text(engine)
    assert "# Instructions\n\nYou are terse." in text
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"sky": "clear"}<|end|><|start|>assistant'
    )


def test_several_tool_calls_streamed(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say(TWO_CALLS)
    _, choices = collect(client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, stream=True))
    calls = choices[0]["calls"]
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["arguments"]) == {"zone": "CET"} and calls[0]["id"] != calls[1]["id"]
    assert choices[0]["finish"] == "tool_calls" and choices[0]["content"] == ""

    engine.say(TWO_CALLS)
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)
    assert [c.function.name for c in completion.choices[0].message.tool_calls] == ["get_weather", "get_time"]

    # parallel_tool_calls=false: the choice ends with its first call, streamed or not.
    engine.say(TWO_CALLS)
    one = client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    assert one.choices[0].finish_reason == "tool_calls"
    wait_for(lambda: engine.calls[-1].finish_reason == "abort")  # (it lands after the reply)
    engine.say(TWO_CALLS)
    _, choices = collect(
        client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, stream=True, parallel_tool_calls=False)
    )
    assert [c["name"] for c in choices[0]["calls"].values()] == ["get_weather"]
    assert choices[0]["finish"] == "tool_calls"


def test_sampling_options_reach_the_engine(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say(REASONED, REASONED)
    completion = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        n=2,
        seed=7,
        temperature=0.5,
        top_p=0.9,
        max_completion_tokens=100,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={"15": 5, "16": -100},
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.message.content == "Hello, world!" for c in completion.choices)
    s0, s1 = (call.request.sampling for call in engine.calls[-2:])
    assert (s0.seed, s1.seed) == (7, 8) and s0.temperature == 0.5 and s0.top_p == 0.9 and s0.max_tokens == 100
    assert s0.frequency_penalty == 0.5 and s0.presence_penalty == -0.5 and s0.logit_bias == {15: 5, 16: -100}
    assert completion.usage.completion_tokens == 2 * len(harmony_tokens(REASONED))


def test_stop_strings_and_length(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say("<|channel|>final<|message|>one two three four five<|return|>")
    stopped = client.chat.completions.create(model=MODEL, messages=HELLO, stop=["three"])
    assert stopped.choices[0].message.content == "one two " and stopped.choices[0].finish_reason == "stop"
    wait_for(lambda: engine.calls[-1].finish_reason == "abort")  # stopped at the stop string, after the reply

    engine.say("<|channel|>final<|message|>one two three four five<|return|>")
    _, choices = collect(client.chat.completions.create(model=MODEL, messages=HELLO, stop="thr", stream=True))
    assert choices[0]["content"] == "one two " and choices[0]["finish"] == "stop"

    # Logprobs follow the text: the tokens a stop string cuts into, or that come after it, have none.
    def spelled(entries) -> str:
        return "".join(lp.token for lp in entries)

    for stop in ("three", "o t", "e", "one two three four five"):
        engine.say("<|channel|>final<|message|>one two three four five<|return|>")
        cut = client.chat.completions.create(model=MODEL, messages=HELLO, stop=[stop], logprobs=True).choices[0]
        assert cut.message.content.startswith(spelled(cut.logprobs.content)), stop
        assert len(cut.message.content) - len(spelled(cut.logprobs.content)) < len(" three")
        engine.say("<|channel|>final<|message|>one two three four five<|return|>")
        _, streamed = collect(
            client.chat.completions.create(model=MODEL, messages=HELLO, stop=[stop], logprobs=True, stream=True)
        )
        assert spelled(streamed[0]["logprobs"]) == spelled(cut.logprobs.content), stop
    engine.say("<|channel|>final<|message|>one two three four five<|return|>")
    kept = client.chat.completions.create(model=MODEL, messages=HELLO, stop=["fiver"], logprobs=True).choices[0]
    assert spelled(kept.logprobs.content) == kept.message.content == "one two three four five"
    # Malformed output shows no Harmony markup, and its logprobs spell no markup either.
    engine.say("<|channel|>final" + " word" * 60 + "<|message|>hi<|return|>")
    malformed = client.chat.completions.create(model=MODEL, messages=HELLO, logprobs=True).choices[0]
    assert "<|" not in malformed.message.content
    assert spelled(malformed.logprobs.content) == malformed.message.content

    engine.say(REASONED)
    short = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=9)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 9


def test_logprobs_shapes(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say(REASONED)
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, logprobs=True, top_logprobs=3)
    content = completion.choices[0].logprobs.content
    tokens = harmony_tokens("Hello, world!")
    assert [lp.token for lp in content] == [harmony_encoding().decode([t]) for t in tokens]
    assert b"".join(bytes(lp.bytes) for lp in content) == b"Hello, world!"
    assert all(lp.logprob == -0.25 and len(lp.top_logprobs) == 3 for lp in content)

    engine.say(REASONED)
    _, choices = collect(client.chat.completions.create(model=MODEL, messages=HELLO, logprobs=True, stream=True))
    assert "".join(lp.token for lp in choices[0]["logprobs"]) == "Hello, world!"


def test_bad_chat_requests(fake_server):
    url = f"{fake_server.url}/v1/chat/completions"

    def error(body, status=400):
        r = httpx.post(url, json=body)
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert error({"model": MODEL, "messages": []})["param"] == "messages"
    assert error({"model": MODEL, "messages": HELLO, "top_logprobs": 2})["param"] == "top_logprobs"
    assert error({"model": MODEL, "messages": HELLO, "logit_bias": {"999999": 1}})["param"] == "logit_bias"
    assert error({"model": MODEL, "messages": HELLO, "logit_bias": {"abc": 1}})["param"] == "logit_bias"
    assert error({"model": MODEL, "messages": HELLO, "n": 0})["param"] == "n"
    assert error({"model": MODEL, "messages": HELLO, "reasoning_effort": "extreme"})["param"] == "reasoning_effort"
    image = error({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert image["param"] == "messages[0].content[0]" and image["code"] == "unsupported_value"
    assert "gpt-oss reads text only" in image["message"]
    assert (
        error({"model": MODEL, "messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]})["param"]
        == "messages[0].tool_call_id"
    )
    assert (
        error(
            {
                "model": MODEL,
                "messages": HELLO,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
            }
        )["param"]
        == "response_format.json_schema.schema"
    )
    assert error({"model": MODEL, "messages": HELLO, "tool_choice": "required"})["param"] == "tool_choice"
    assert error({"model": MODEL, "messages": HELLO, "parallel_tool_calls": False})["param"] == "parallel_tool_calls"
    assert (
        error({"model": MODEL, "messages": HELLO, "stream_options": {"include_usage": True}})["param"]
        == "stream_options"
    )
    assert error({"model": "nope", "messages": HELLO}, 404)["code"] == "model_not_found"


def test_tool_calls_and_their_results_pair_up(fake_server):
    """As in OpenAI, every tool call of an assistant message is answered by the tool messages right
    after it, and a tool message answers a call of the assistant message before it: otherwise the
    prompt would show the model a call with no result, or a result with no call before it."""
    url = f"{fake_server.url}/v1/chat/completions"
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
        for i in ("a", "b")
    ]

    def error(messages):
        r = httpx.post(url, json={"model": MODEL, "tools": TOOLS, "messages": messages})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    unanswered = error(
        [
            *HELLO,
            {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "a", "content": "sun"},
            *HELLO,
        ]
    )
    assert "did not have response messages: b" in unanswered["message"] and unanswered["param"] == "messages[1]"
    late = error(
        [
            *HELLO,
            {"role": "assistant", "tool_calls": calls[:1]},
            *HELLO,
            {"role": "tool", "tool_call_id": "a", "content": "SUN_A"},
        ]
    )
    assert late["param"] == "messages[1]"
    twice = error(
        [
            *HELLO,
            {"role": "assistant", "tool_calls": calls[:1]},
            {"role": "tool", "tool_call_id": "a", "content": "sun"},
            {"role": "tool", "tool_call_id": "a", "content": "SUN_A"},
        ]
    )
    assert twice["param"] == "messages[3].tool_call_id"
    ok = httpx.post(
        url,
        json={
            "model": MODEL,
            "tools": TOOLS,
            "messages": [
                *HELLO,
                {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "RAIN_B"},
                {"role": "tool", "tool_call_id": "a", "content": "sun"},
            ],
        },
    )
    assert ok.status_code == 200, ok.text


def test_tool_results_follow_the_order_of_their_calls(fake_server):
    # Harmony has no call ids: the model pairs results with calls by their order.
    engine, client = fake_server.engine, fake_server.client()
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        for i, c in (("a", "Paris"), ("b", "Rome"))
    ]
    client.chat.completions.create(
        model=MODEL,
        tools=TOOLS,
        messages=[
            *HELLO,
            {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "RAIN_B"},
            {"role": "tool", "tool_call_id": "a", "content": "SUN_A"},
        ],
    )
    text = prompt_text(engine)
    assert text.index('"Paris"') < text.index('"Rome"') < text.index("SUN_A") < text.index("RAIN_B")


@pytest.mark.parametrize("name", ["stream", "n", "logprobs", "tools", "frequency_penalty", "functions", "audio"])
def test_an_explicit_null_means_not_given(fake_server, name):
    r = httpx.post(
        f"{fake_server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], name: None},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None


def test_an_assistant_message_sent_back_as_it_came(fake_server):
    # The SDK's message, dumped whole (nulls and all), then the tool result: the preamble beside
    # the call goes back on the commentary channel, where the model wrote it.
    engine, client = fake_server.engine, fake_server.client()
    engine.say(
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
        + ONE_CALL[ONE_CALL.index("<|channel|>commentary") :]
    )
    message = client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS).choices[0].message
    assert message.content == "Let me check." and message.tool_calls
    engine.say(REASONED)
    again = client.chat.completions.create(
        model=MODEL,
        tools=TOOLS,
        messages=[
            *HELLO,
            message.model_dump(),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "20C"},
        ],
    )
    assert again.choices[0].message.content == "Hello, world!"
    text = prompt_text(engine)
    assert "<|channel|>commentary<|message|>Let me check.<|end|>" in text and "final<|message|>Let me" not in text
    # A reply without calls stays a final answer.
    engine.say(REASONED)
    client.chat.completions.create(
        model=MODEL,
        messages=[*HELLO, {"role": "assistant", "content": "Hi!", "function_call": None, "audio": None}, *HELLO],
    )
    assert "<|channel|>final<|message|>Hi!<|end|>" in prompt_text(engine)


def test_json_schema_response_format_reaches_the_prompt(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say('<|channel|>final<|message|>{"answer": 4}<|return|>')
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    completion = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        response_format={"type": "json_schema", "json_schema": {"name": "math", "schema": schema}},
    )
    assert json.loads(completion.choices[0].message.content) == {"answer": 4}
    assert "# Response Formats\n\n## math\n\n" + json.dumps(schema, separators=(",", ":")) in prompt_text(engine)


def test_json_schema_response_format_without_a_schema(fake_server):
    # OpenAI's `json_schema` needs only `name`: `schema` (and `description`, `strict`) are optional.
    engine, client = fake_server.engine, fake_server.client()
    engine.say('<|channel|>final<|message|>{"answer": 4}<|return|>')
    completion = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        response_format={"type": "json_schema", "json_schema": {"name": "anything", "description": "Any JSON value."}},
    )
    assert json.loads(completion.choices[0].message.content) == {"answer": 4}
    assert "# Response Formats\n\n## anything\n\n// Any JSON value.\n" in prompt_text(engine)


def test_client_disconnect_stops_generation(fake_server):
    engine = fake_server.engine
    engine.token_delay = 0.02
    engine.say("<|channel|>final<|message|>" + " word" * 500 + "<|return|>")
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{fake_server.url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "stream": True}
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 10:
                    break
    deadline = time.monotonic() + 20
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == 0 and engine.calls[-1].finish_reason == "abort"
    assert len(engine.calls[-1].generated) < 500


def test_logprobs_match_transformers_on_the_tiny_checkpoint(tiny_engine_server, tiny_checkpoint):
    """From HTTP to the model: the served logprobs are transformers' log-softmax on the same
    weights and tokens (greedy, so the tokens are transformers' argmax too)."""
    transformers = pytest.importorskip("transformers")
    from agent_server.chat.prompt import chat_prompt
    from agent_server.token_bytes import token_bytes
    from schemas.chat import ChatCompletionRequest

    # ignore_eos: no turn grammar (it would mask the logits, and the random model's tokens would
    # go to reasoning, which has no logprobs), so the served tokens are the model's own argmax.
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 4}
    completion = tiny_engine_server.client().chat.completions.create(**body, extra_body={"ignore_eos": True})
    served = completion.choices[0].logprobs.content
    assert len(served) == completion.usage.completion_tokens == 8

    hf = transformers.GptOssForCausalLM.from_pretrained(
        tiny_checkpoint,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    ids = chat_prompt(ChatCompletionRequest.model_validate(body))
    with torch.no_grad():
        for entry in served:
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(logprobs.argmax())
            assert bytes(entry.bytes) == token_bytes(token)
            assert entry.logprob == pytest.approx(float(logprobs[token]), abs=2e-3)
            top_values, top_ids = logprobs.topk(4)
            assert [bytes(t.bytes) for t in entry.top_logprobs] == [token_bytes(int(i)) for i in top_ids]
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=2e-3)
            ids.append(token)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_unicode_line_separators_leave_every_event_one_line(fake_server, api):
    # pydantic writes U+2028, U+2029 and U+0085 raw; clients that read SSE with str.splitlines
    # (httpx's iter_lines) would cut the event there. The server escapes them inside the JSON.
    text = "a\u2028b\u2029c\x85d"
    fake_server.engine.say(f"<|channel|>final<|message|>{text}<|return|>")
    path, body = (
        ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "stream": True})
        if api == "chat"
        else ("/v1/responses", {"model": MODEL, "input": "Say hello.", "stream": True})
    )
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{fake_server.url}{path}", json=body) as r:
            raw = r.read().decode()
    assert not any(c in raw for c in "\u2028\u2029\x85")
    events = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:") and "[DONE]" not in line]
    if api == "chat":
        streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    else:
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == text


@pytest.mark.parametrize("n", [1, 2])
def test_every_streamed_chunk_is_exactly_an_sdk_chunk(fake_server, n):
    # The chunks are JSON built from dicts (no pydantic per token): each must validate as the
    # SDK's ChatCompletionChunk and dump back to the same JSON (no field the type lacks or coerces).
    from openai.types.chat import ChatCompletionChunk

    for _ in range(n):
        fake_server.engine.say(ONE_CALL)
    body = {
        "model": MODEL,
        "messages": HELLO,
        "tools": TOOLS,
        "stream": True,
        "n": n,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{fake_server.url}/v1/chat/completions", json=body) as r:
            raw = r.read().decode()
    assert "\r" not in raw  # lines end in "\n", as OpenAI's
    payloads = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    kinds = set()
    for payload in payloads[:-1]:
        data = json.loads(payload)
        chunk = ChatCompletionChunk.model_validate(data)
        assert chunk.model_dump(mode="json", exclude_unset=True) == data
        for c in chunk.choices:
            kinds |= {k for k, v in c.delta.model_dump(exclude_unset=True).items() if v}
    assert {"role", "reasoning", "reasoning_content", "tool_calls"} <= kinds
    assert json.loads(payloads[-2])["usage"]["completion_tokens"] > 0


def test_events_are_sent_without_a_cancel_scope_each(fake_server, monkeypatch):
    # EventStreamResponse overrides sse-starlette's private `_send_with_timeout`; if a release
    # renames it, the override goes dead silently. Every event must still pass through it.
    import anyio

    from agent_server.sse import EventStreamResponse

    calls, scopes = [], []
    override = EventStreamResponse._send_with_timeout

    async def counted(self, send, message):
        calls.append(message["type"])
        await override(self, send, message)

    real_move_on_after = anyio.move_on_after
    monkeypatch.setattr(EventStreamResponse, "_send_with_timeout", counted)
    monkeypatch.setattr(anyio, "move_on_after", lambda *a, **k: scopes.append(a) or real_move_on_after(*a, **k))
    fake_server.engine.say(REASONED)
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{fake_server.url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "stream": True}
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(calls) == len(events) > 5
    assert scopes == []
