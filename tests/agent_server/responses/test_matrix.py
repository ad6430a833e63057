"""The Responses API scenarios x {create, stream} x {scripted engine, tiny real engine}.

Every scenario of the issue (plain answer with reasoning, web search then a cited answer, a
code-interpreter call, a function call and its output, `previous_response_id` chaining) runs
through the official client's `responses.create` and `responses.stream`, on the scripted engine
and on the real engine teacher-forced through the same script (`tool_server`), so the item
assertions are exact on both.

What the client received is also checked strictly, from the raw bytes (a recording transport
under the SDK): each SSE event validates with `strict=True` against the SDK's own
`ResponseStreamEvent` union, lands on the class its `type` names and carries no field the SDK
does not know; non-streamed bodies validate as `Response` the same way; and the stream follows
OpenAI's order: created, in_progress, then each output item as one uninterrupted block
(`output_item.added`, that item type's events in their order, `output_item.done`), then the
terminal event.

The other tests pin request parameters to what the engine receives (the scripted engine keeps
every `GenerationRequest`): instructions, sampling, tool_choice, tool namespaces, prior reasoning
items, `user`, `text.format`, `parallel_tool_calls`, keep-alive pings.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from agent_server.harmony import continuation_tokens, tool_message
from tests.agent_server.responses.test_routes import (
    ANSWER,
    CITED,
    PYTHON,
    SEARCH,
    WEATHER_CALL,
    WEATHER_TOOL,
    check_stream_invariants,
    prompt_text,
)
from tests.conftest import MODEL, LiveServer, make_app
from tests.fake_engine import ScriptedEngine, harmony_tokens

MODES = ["create", "stream"]
EVENT = TypeAdapter(ResponseStreamEvent)
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "Local time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
TWO_CALLS = (
    WEATHER_CALL.replace("<|call|>", "<|end|>") + "<|start|>assistant<|channel|>commentary "
    'to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}<|call|>'
)
MCP_TOOL = {"type": "mcp", "server_label": "weather", "require_approval": "never"}
CODE_TOOL = {"type": "code_interpreter", "container": {"type": "auto"}}


# --- what the client received, checked from the raw bytes -------------------------------


class _Tee(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, sink: bytearray):
        self.inner, self.sink = inner, sink

    def __iter__(self):
        for chunk in self.inner:
            self.sink += chunk
            yield chunk

    def close(self) -> None:
        self.inner.close()


class RecordingTransport(httpx.BaseTransport):
    """httpx transport that keeps a copy of every response body the SDK reads."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.bodies: list[bytearray] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        self.bodies.append(bytearray())
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            extensions=response.extensions,
            stream=_Tee(response.stream, self.bodies[-1]),
            request=request,
        )

    def close(self) -> None:
        self.inner.close()


def parse_sse(body: bytes) -> tuple[list[dict[str, Any]], list[str]]:
    """(events as JSON, comment lines such as keep-alive pings) of an SSE body."""
    events, comments = [], []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if data:
            event = json.loads("\n".join(data))
            assert name == event["type"], "the SSE event name must be the event's type"
            events.append(event)
    return events, comments


# Fields of OpenAI's response objects that the SDK's Response type does not declare.
OPENAI_ONLY = {Response: {"store", "frequency_penalty", "presence_penalty"}}


def assert_no_unknown_fields(value: Any, path: str = "") -> None:
    """Nothing in a validated SDK object landed in `model_extra` (a field the SDK does not know),
    but the fields OpenAI's objects carry that the SDK leaves out (`OPENAI_ONLY`)."""
    if isinstance(value, BaseModel):
        extra = {k: v for k, v in (value.model_extra or {}).items() if k not in OPENAI_ONLY.get(type(value), ())}
        assert not extra, f"{path or type(value).__name__}: fields unknown to the SDK: {extra}"
        for name in type(value).model_fields:
            assert_no_unknown_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            assert_no_unknown_fields(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            assert_no_unknown_fields(item, f"{path}.{key}")


def strict_event(raw: dict[str, Any]) -> Any:
    event = EVENT.validate_python(raw, strict=True)
    assert event.type == raw["type"] and type(event).model_fields["type"].annotation.__args__ == (raw["type"],)
    assert_no_unknown_fields(event, raw["type"])
    return event


def strict_response(raw: dict[str, Any]) -> Response:
    response = Response.model_validate(raw, strict=True)
    assert_no_unknown_fields(response, "response")
    return response


# The events of one output item between its output_item.added and output_item.done, in the
# order OpenAI's service sends them ("response." dropped).
ITEM_EVENTS = {
    "message": r"content_part\.added (output_text\.delta (output_text\.annotation\.added )*)*"
    r"output_text\.done content_part\.done ",
    "reasoning": r"content_part\.added (reasoning_text\.delta )*reasoning_text\.done content_part\.done ",
    "function_call": r"(function_call_arguments\.delta )*function_call_arguments\.done ",
    "web_search_call": r"web_search_call\.in_progress web_search_call\.searching web_search_call\.completed ",
    "code_interpreter_call": r"code_interpreter_call\.in_progress (code_interpreter_call_code\.delta )*"
    r"code_interpreter_call_code\.done code_interpreter_call\.interpreting "
    r"code_interpreter_call\.completed ",
    "mcp_list_tools": r"mcp_list_tools\.in_progress mcp_list_tools\.completed ",
    "mcp_call": r"(mcp_call_arguments\.delta )*mcp_call_arguments\.done mcp_call\.in_progress "
    r"mcp_call\.(completed|failed) ",
}


def check_event_order(raw_events: list[dict[str, Any]]) -> None:
    kinds = [e["type"].removeprefix("response.") for e in raw_events]
    assert kinds[:2] == ["created", "in_progress"] and kinds[-1] in ("completed", "incomplete", "failed")
    body = raw_events[2:-1]
    index = 0
    while body:
        added = body[0]
        assert added["type"] == "response.output_item.added" and added["output_index"] == index, added
        end = next(i for i, e in enumerate(body) if e["type"] == "response.output_item.done")
        block, body = body[1:end], body[end + 1 :]
        assert all(e.get("output_index") == index for e in block), "items interleave"
        inner = "".join(e["type"].removeprefix("response.") + " " for e in block)
        item_type = added["item"]["type"]
        assert re.fullmatch(ITEM_EVENTS[item_type], inner), f"{item_type} events out of order: {inner}"
        index += 1


def respond(server: LiveServer, mode: str, **request):
    """Run one request with the official client (create or stream), check what came over the
    wire strictly, and return (final response, the SDK's events or None)."""
    transport = RecordingTransport()
    with httpx.Client(transport=transport, timeout=120) as http:
        return _respond(server.client(http_client=http), transport, mode, request)


def _respond(client, transport: RecordingTransport, mode: str, request: dict[str, Any]):
    if mode == "create":
        response = client.responses.create(model=MODEL, **request)
        raw = strict_response(json.loads(bytes(transport.bodies[-1])))
        assert plain(raw) == plain(response)
        events = None
    else:
        with client.responses.stream(model=MODEL, **request) as stream:
            events = list(stream)
            response = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
        raw_events, _ = parse_sse(bytes(transport.bodies[-1]))
        assert [e.type for e in events] == [e["type"] for e in raw_events]  # the SDK parsed every event
        for raw in raw_events:
            strict_event(raw)
        check_event_order(raw_events)
        check_stream_invariants(events, response)
    if request.get("store", True):
        stored = client.responses.retrieve(response.id)
        assert plain(stored) == plain(response)
    return response, events


def plain(response) -> dict:
    """A response as JSON, without the SDK's client-side additions (`parsed`, `parsed_arguments`)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not k.startswith("parsed")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(response.model_dump(mode="json"))


def types(response) -> list[str]:
    return [item.type for item in response.output]


# --- the five scenarios, each created and streamed, on both engines ------------------------


@pytest.mark.parametrize("mode", MODES)
def test_plain_answer_with_reasoning(tool_server, mode):
    engine = tool_server.engine
    engine.say(ANSWER)
    response, events = respond(tool_server, mode, input="Hi!", reasoning={"effort": "low"}, max_output_tokens=64)
    assert response.status == "completed" and response.error is None and types(response) == ["reasoning", "message"]
    reasoning, message = response.output
    assert reasoning.content[0].text == "The user greets me." and reasoning.status == "completed"
    assert message.role == "assistant" and message.status == "completed" and message.phase == "final_answer"
    assert response.output_text == "Hello! How can I help?" and response.reasoning.effort == "low"
    (call,) = engine.calls
    assert "Reasoning: low" in prompt_text(call) and prompt_text(call).endswith("Hi!<|end|><|start|>assistant")
    usage = response.usage
    assert usage.input_tokens == len(call.request.prompt_token_ids)
    assert usage.output_tokens == len(harmony_tokens(ANSWER))
    assert usage.output_tokens_details.reasoning_tokens == len(
        harmony_tokens("<|channel|>analysis<|message|>The user greets me.<|end|>")
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if events is not None:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 1 and "".join(deltas) == "Hello! How can I help?"  # streamed as generated


@pytest.mark.parametrize("mode", MODES)
def test_web_search_then_cited_answer(tool_server, fake_tools, mode):
    engine = tool_server.engine
    engine.say(SEARCH, CITED)
    response, events = respond(
        tool_server,
        mode,
        input="What license does gpt-oss use?",
        tools=[{"type": "web_search_preview"}],
        include=["web_search_call.action.sources"],
    )
    assert response.status == "completed" and types(response) == ["reasoning", "web_search_call", "message"]
    search, message = response.output[1:]
    assert search.status == "completed" and search.action.type == "search" and search.action.query == "gpt-oss license"
    assert [s.url for s in search.action.sources] == ["https://example.org/oss", "https://example.org/harmony"]
    text = message.content[0]
    assert text.text == "gpt-oss is Apache-2.0 licensed [gpt-oss release notes]."
    (citation,) = text.annotations
    assert citation.type == "url_citation" and citation.url == "https://example.org/oss"
    assert text.text[citation.start_index : citation.end_index] == "[gpt-oss release notes]"
    assert fake_tools["browser"].calls == [("browser.search", '{"query": "gpt-oss license"}')]
    if events is not None:
        (added,) = [e for e in events if e.type == "response.output_text.annotation.added"]
        annotation = added.annotation if isinstance(added.annotation, dict) else added.annotation.model_dump()
        assert annotation["url"] == citation.url and added.annotation_index == 0
    # The answer continued the searching turn's cached sequence: only the tool message was prefilled.
    first, second = engine.calls
    results = (
        "# Search results for 'gpt-oss license'\n【0†gpt-oss release notes†https://example.org/oss】\n"
        "【1†The Harmony format†https://example.org/harmony】"
    )
    suffix = continuation_tokens([tool_message("browser.search", results)])
    assert second.request.prompt_token_ids == first.request.prompt_token_ids + first.generated + suffix
    assert second.num_cached_tokens == len(first.request.prompt_token_ids) + len(first.generated) - 1
    assert response.usage.input_tokens_details.cached_tokens == first.num_cached_tokens + second.num_cached_tokens


@pytest.mark.parametrize("mode", MODES)
def test_code_interpreter_call(tool_server, fake_tools, mode):
    engine = tool_server.engine
    engine.say(PYTHON, "<|channel|>final<|message|>6 times 7 is 42.<|return|>")
    response, events = respond(
        tool_server,
        mode,
        input="What is 6*7? Use python.",
        tools=[CODE_TOOL],
        include=["code_interpreter_call.outputs"],
    )
    assert response.status == "completed" and types(response) == ["code_interpreter_call", "message"]
    call, message = response.output
    assert call.code == "print(6 * 7)" and call.status == "completed" and call.container_id.startswith("cntr_")
    assert [(o.type, o.logs) for o in call.outputs] == [("logs", "42\n")]
    assert message.content[0].text == "6 times 7 is 42." and fake_tools["python"].calls == ["print(6 * 7)"]
    if events is not None:
        code = "".join(e.delta for e in events if e.type == "response.code_interpreter_call_code.delta")
        assert code == "print(6 * 7)"
    first, second = engine.calls
    assert second.num_prefilled == len(continuation_tokens([tool_message("python", "42\n")])) + 1


@pytest.mark.parametrize("mode", MODES)
def test_function_call_and_its_output(tool_server, mode):
    engine = tool_server.engine
    engine.say("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + WEATHER_CALL)
    first, events = respond(tool_server, mode, input="Weather in Paris?", tools=[WEATHER_TOOL])
    assert first.status == "completed" and types(first) == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    if events is not None:
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments == call.arguments and done.item_id == call.id

    engine.say("<|channel|>final<|message|>It is 21°C and clear in Paris.<|return|>")
    second, _ = respond(
        tool_server,
        mode,
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}],
    )
    assert second.status == "completed" and second.output_text == "It is 21°C and clear in Paris."
    assert prompt_text(engine.calls[-1]).endswith(
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
        '<|message|>{"temperature_c": 21}<|end|><|start|>assistant'
    )


@pytest.mark.parametrize("mode", MODES)
def test_previous_response_id_chaining(tool_server, mode):
    engine = tool_server.engine
    engine.say(
        "<|channel|>final<|message|>Nice to meet you, Ada.<|return|>",
        "<|channel|>analysis<|message|>Name was given earlier.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Your name is Ada.<|return|>",
    )
    first, _ = respond(tool_server, mode, input="My name is Ada.")
    second, _ = respond(tool_server, mode, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "Your name is Ada."
    text = prompt_text(engine.calls[-1])
    assert (
        "<|start|>user<|message|>My name is Ada.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Nice to meet you, Ada.<|end|><|start|>user<|message|>What is my name?<|end|><|start|>assistant"
    ) in text
    # The second prompt starts with the first conversation, which the prefix cache still holds.
    assert second.usage.input_tokens_details.cached_tokens > 0
    items = tool_server.client().responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]


# --- parallel_tool_calls ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_parallel_tool_calls_false_allows_one_function_call(tool_server, mode):
    engine = tool_server.engine
    engine.say(TWO_CALLS)
    both, _ = respond(tool_server, mode, input="Weather and time?", tools=[WEATHER_TOOL, TIME_TOOL])
    assert [c.name for c in both.output] == ["get_weather", "get_time"] and both.parallel_tool_calls

    engine.say(TWO_CALLS)
    one, events = respond(
        tool_server, mode, input="Weather and time?", tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False
    )
    assert one.status == "completed" and not one.parallel_tool_calls
    (call,) = one.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    first_call = harmony_tokens(WEATHER_CALL.replace("<|call|>", "<|end|>"))
    assert one.usage.output_tokens == len(first_call)  # generation stopped after the first call
    if isinstance(engine, ScriptedEngine):
        assert engine.calls[-1].generated == first_call
    if events is not None:
        assert [e.type for e in events].count("response.function_call_arguments.done") == 1
    # Its output continues the conversation like any function call's.
    engine.say("<|channel|>final<|message|>Sunny.<|return|>")
    after, _ = respond(
        tool_server,
        mode,
        previous_response_id=one.id,
        tools=[WEATHER_TOOL, TIME_TOOL],
        parallel_tool_calls=False,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert after.output_text == "Sunny." and "get_time" not in prompt_text(engine.calls[-1]).split("<|start|>user")[-1]


# --- request parameters reach the prompt and the engine ----------------------------------


def developer_message(text: str) -> str:
    start = text.index("<|start|>developer<|message|>")
    return text[start : text.index("<|end|>", start)]


def system_message(text: str) -> str:
    return text[: text.index("<|end|>")]


@pytest.mark.parametrize("mode", MODES)
def test_instructions_lead_the_developer_message(fake_server, mode):
    engine = fake_server.engine
    response, _ = respond(
        fake_server,
        mode,
        instructions="Answer in French.",
        input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert response.instructions == "Answer in French."
    assert (
        developer_message(prompt_text(engine.calls[-1]))
        == "<|start|>developer<|message|># Instructions\n\nAnswer in French.\n\nBe brief."
    )
    respond(fake_server, mode, input="Hi")
    assert "<|start|>developer" not in prompt_text(engine.calls[-1])  # nothing to say, no developer message


def test_sampling_parameters_reach_the_engine(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    response = client.responses.create(model=MODEL, input="Hi", temperature=0.3, top_p=0.25, max_output_tokens=40)
    sampling = engine.calls[-1].request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.3, 0.25, 40)
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.3, 0.25, 40)
    client.responses.create(model=MODEL, input="Hi")
    sampling = engine.calls[-1].request.sampling
    assert (sampling.temperature, sampling.top_p) == (1.0, 1.0)


def output_texts(response) -> list[tuple[str, str]]:
    texts = []
    for item in response.output:
        content = getattr(item, "content", None) or []
        texts.append((item.type, "".join(getattr(c, "text", "") for c in content)))
    return texts


def test_top_p_truncates_what_the_real_engine_samples(tiny_engine_server):
    """A nucleus of 1e-6 is below any token's probability over a 201k vocabulary, so it holds the
    single best token and sampling at temperature 1 gives the greedy output. Without top_p, the
    tiny model's nearly flat distribution (p_max ~ 3e-4) makes that practically impossible."""
    client = tiny_engine_server.client()
    common = dict(model=MODEL, input="Hi!", max_output_tokens=8)
    greedy = client.responses.create(temperature=0, **common)
    nucleus = client.responses.create(temperature=1.0, top_p=1e-6, **common)
    sampled = client.responses.create(temperature=1.0, top_p=1.0, **common)
    assert output_texts(nucleus) == output_texts(greedy) and nucleus.usage.output_tokens == 8
    assert output_texts(sampled) != output_texts(greedy)


ALL_TOOLS = [{"type": "web_search_preview"}, CODE_TOOL, MCP_TOOL, WEATHER_TOOL]


def test_builtin_tool_namespaces_are_in_the_system_message(fake_server):
    engine, client = fake_server.engine, fake_server.client()

    def system_for(tools) -> str:
        client.responses.create(model=MODEL, input="Hi", tools=tools)
        return system_message(prompt_text(engine.calls[-1]))

    browser = system_for([{"type": "web_search_preview"}])
    assert "# Tools\n\n## browser\n\n// Tool for browsing." in browser and "namespace browser {" in browser
    assert "type search = (_: {" in browser and "## python" not in browser
    python = system_for([CODE_TOOL])
    assert "# Tools\n\n## python\n\nUse this tool to execute Python code" in python and "## browser" not in python
    mcp = system_for([MCP_TOOL])
    assert "## weather\n\n// Weather tools\nnamespace weather {" in mcp and "type get_forecast" in mcp
    every = system_for(ALL_TOOLS)
    assert every.index("## browser") < every.index("## python") < every.index("## weather")
    plain_system = system_for([WEATHER_TOOL])  # function tools live in the developer message
    assert "# Tools" not in plain_system
    assert "namespace functions {" in developer_message(prompt_text(engine.calls[-1]))


def test_tool_choice_none_hides_every_tool(fake_server, fake_tools):
    engine, client = fake_server.engine, fake_server.client()
    client.responses.create(model=MODEL, input="Hi", tools=ALL_TOOLS)
    enabled = prompt_text(engine.calls[-1])
    for marker in ("## browser", "## python", "namespace weather {", "type get_weather"):
        assert marker in enabled
    response = client.responses.create(model=MODEL, input="Hi", tools=ALL_TOOLS, tool_choice="none")
    assert response.tool_choice == "none"
    hidden = prompt_text(engine.calls[-1])
    for marker in ("# Tools", "## browser", "## python", "weather", "get_weather", "namespace functions"):
        assert marker not in hidden
    assert not engine.calls[-1].request.keep_alive  # no built-in tool can run, nothing to park
    # A call the model makes anyway goes nowhere: it stays text, no tool runs.
    engine.say(PYTHON)
    response = client.responses.create(model=MODEL, input="Hi", tools=ALL_TOOLS, tool_choice="none")
    assert types(response) == ["message"] and response.output[0].status == "incomplete"
    assert fake_tools["python"].calls == []


def forced_recipients(engine) -> list[str]:
    """The recipients the grammar of the last request forces its turn to call (none: not forced)."""
    grammar = engine.calls[-1].request.sampling.grammar
    if grammar is None or not grammar.text.startswith("start: call_"):
        return []
    return sorted(
        line.split(" to=")[1].split(" ")[0].rstrip('"')
        for line in grammar.text.splitlines()
        if line.startswith("call_")
    )


def test_tool_choice_required_and_named_force_the_call(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    client.responses.create(model=MODEL, input="Hi", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    assert forced_recipients(engine) == ["functions.get_time", "functions.get_weather"]
    response = client.responses.create(
        model=MODEL, input="Hi", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "function", "name": "get_time"}
    )
    assert response.tool_choice.name == "get_time"
    assert forced_recipients(engine) == ["functions.get_time"]
    developer = developer_message(prompt_text(engine.calls[-1]))
    assert "You must" not in developer and "type get_weather" in developer
    client.responses.create(model=MODEL, input="Hi", tools=[CODE_TOOL], tool_choice={"type": "code_interpreter"})
    assert forced_recipients(engine) == ["python"]
    client.responses.create(model=MODEL, input="Hi", tools=[WEATHER_TOOL])
    assert forced_recipients(engine) == []


def test_function_call_items_come_with_their_outputs(fake_server):
    """As in OpenAI, a function_call in the input needs its function_call_output: the model would
    read a call with no result. One the token limit cut short (incomplete) needs none and is left
    out of the prompt."""
    engine, client = fake_server.engine, fake_server.client()
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}
    r = httpx.post(
        f"{fake_server.url}/v1/responses",
        json={
            "model": MODEL,
            "tools": [WEATHER_TOOL],
            "input": [{"role": "user", "content": "Weather?"}, call, {"role": "user", "content": "Never mind."}],
        },
    )
    assert r.status_code == 400 and "call_1" in r.json()["error"]["message"]
    client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather?"},
            {**call, "arguments": '{"ci', "status": "incomplete"},
            {"role": "user", "content": "Go on."},
        ],
    )
    assert "to=functions.get_weather" not in prompt_text(engine.calls[-1])


def test_prior_reasoning_items_are_analysis_messages(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Paris weather needed."}],
    }
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}
    client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather?"},
            reasoning,
            call,
            {"type": "function_call_output", "call_id": "call_1", "output": "21"},
        ],
    )
    # Reasoning before a tool call stays in the prompt (the model continues that turn)...
    assert prompt_text(engine.calls[-1]).endswith(
        "<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>analysis<|message|>"
        "Paris weather needed.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
        '<|constrain|>json<|message|>{"city":"Paris"}<|call|><|start|>functions.get_weather to=assistant'
        "<|channel|>commentary<|message|>21<|end|><|start|>assistant"
    )
    # ...and one before a final answer is dropped, as gpt-oss expects for finished turns.
    client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Hi"},
            reasoning,
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again"},
        ],
    )
    text = prompt_text(engine.calls[-1])
    assert "Paris weather needed." not in text and "<|channel|>final<|message|>Hello.<|end|>" in text
    # A summary stands in for missing content.
    summary_only = {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Sum."}]}
    client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather?"},
            summary_only,
            call,
            {"type": "function_call_output", "call_id": "call_1", "output": "21"},
        ],
    )
    assert "<|channel|>analysis<|message|>Sum.<|end|>" in prompt_text(engine.calls[-1])


@pytest.mark.parametrize("mode", MODES)
def test_user_is_echoed_and_stored(fake_server, mode):
    response, events = respond(fake_server, mode, input="Hi", user="user-42", metadata={"k": "v"})
    assert response.user == "user-42" and response.metadata == {"k": "v"}
    if events is not None:
        assert events[0].response.user == "user-42"


@pytest.mark.parametrize("mode", MODES)
def test_json_schema_text_format(tool_server, mode):
    engine = tool_server.engine
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    engine.say('<|channel|>final<|message|>{"answer": 4}<|return|>')
    response, _ = respond(
        tool_server,
        mode,
        input="2+2?",
        text={
            "format": {
                "type": "json_schema",
                "name": "math",
                "schema": schema,
                "strict": True,
                "description": "The sum",
            }
        },
    )
    fmt = response.text.format
    assert (fmt.type, fmt.name, fmt.schema_, fmt.strict) == ("json_schema", "math", schema, True)
    assert json.loads(response.output_text) == {"answer": 4}
    assert (
        "# Response Formats\n\n## math\n\n// The sum\n" + json.dumps(schema, separators=(",", ":"))
    ) in developer_message(prompt_text(engine.calls[-1]))


def test_keep_alive_pings_while_the_model_is_slow(tmp_path):
    engine = ScriptedEngine(token_delay=0.25).say("<|channel|>final<|message|> a b c<|return|>")
    app = make_app(lambda: engine, tmp_path / "r.db", sse_ping_seconds=0.1)
    with LiveServer(app) as server:
        transport = RecordingTransport()
        with httpx.Client(transport=transport, timeout=60) as http:
            with server.client(http_client=http).responses.stream(model=MODEL, input="x") as stream:
                events = list(stream)
    raw_events, comments = parse_sse(bytes(transport.bodies[-1]))
    assert len(comments) >= 3 and all(c.startswith(": ping") for c in comments)
    # The pings are invisible to the client: it parsed every event and the answer.
    assert [e.type for e in events] == [e["type"] for e in raw_events] and events[-1].type == "response.completed"
    assert events[-1].response.output_text == " a b c"
    for raw in raw_events:
        strict_event(raw)
