"""Chat Completions `tool_choice` and the `developer` role against the live server.

The scripted engine keeps each `GenerationRequest`, so the tests read the Harmony prompt the
model was given and the grammar its turn is held to: `none` leaves the functions out, `required`
and a named function force the call through the grammar (`agent_server/turn_grammar.py`; the
live tests on the tiny model are in `tests/agent_server/test_turn_grammar_live.py`), and a
developer message joins the instructions like a system one. The developer role also runs on the
tiny real engine.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.agent_server.chat.test_routes import HELLO, ONE_CALL, TOOLS, collect, prompt_text
from tests.conftest import MODEL


def developer_message(text: str) -> str:
    start = text.index("<|start|>developer<|message|>")
    return text[start : text.index("<|end|>", start)]


def test_tool_choice_none_leaves_the_functions_out(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)
    offered = prompt_text(engine)
    assert "namespace functions {" in offered and "type get_weather" in offered and "type get_time" in offered
    engine.say("<|channel|>final<|message|>No tools needed.<|return|>")
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, tool_choice="none")
    assert completion.choices[0].message.content == "No tools needed."
    assert completion.choices[0].message.tool_calls is None and completion.choices[0].finish_reason == "stop"
    hidden = prompt_text(engine)
    assert "namespace functions" not in hidden and "get_weather" not in hidden and "get_time" not in hidden


def forced_recipients(engine) -> list[str]:
    """The recipients the grammar of the last request forces its turn to call (none: not forced)."""
    grammar = engine.calls[-1].request.sampling.grammar
    if grammar is None or not grammar.text.startswith("start: call_"):
        return []
    return sorted(line.split(" to=")[1].split(" ")[0] for line in grammar.text.splitlines() if line.startswith("call_"))


def test_tool_choice_required_forces_a_call_and_the_call_comes_back(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say(ONE_CALL)
    _, choices = collect(
        client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, tool_choice="required", stream=True)
    )
    assert forced_recipients(engine) == ["functions.get_time", "functions.get_weather"]
    developer = developer_message(prompt_text(engine))
    assert "You must" not in developer and "type get_weather" in developer
    (call,) = choices[0]["calls"].values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert choices[0]["finish"] == "tool_calls"


def test_named_tool_choice(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}<|call|>')
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "get_time" and completion.choices[0].finish_reason == "tool_calls"
    assert forced_recipients(engine) == ["functions.get_time"]
    assert "type get_weather" in developer_message(prompt_text(engine))  # every function is still described
    client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)
    assert forced_recipients(engine) == []  # auto forces nothing

    r = httpx.post(
        f"{fake_server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": HELLO,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_developer_role_joins_the_instructions(live_server):
    client = live_server.client()
    if live_server.kind == "fake":
        live_server.engine.say("<|channel|>final<|message|>Short.<|return|>")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Answer in haiku."},
        *HELLO,
    ]
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length")
    if live_server.kind == "tiny":  # the real engine takes the same prompt; its text is noise
        assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens <= 16
        return
    assert completion.choices[0].message.content == "Short."
    text = prompt_text(live_server.engine)
    assert (
        developer_message(text) == "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\nAnswer in haiku."
    )
    assert text.endswith("<|start|>user<|message|>Say hello.<|end|><|start|>assistant")


@pytest.mark.parametrize("stream", [False, True])
def test_developer_role_with_tools(fake_server, stream):
    engine, client = fake_server.engine, fake_server.client()
    engine.say("<|channel|>final<|message|>Ok.<|return|>")
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Prefer metric units."}]}, *HELLO]
    result = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=stream)
    content = collect(result)[1][0]["content"] if stream else result.choices[0].message.content
    assert content == "Ok."
    developer = developer_message(prompt_text(engine))
    assert developer.startswith("<|start|>developer<|message|># Instructions\n\nPrefer metric units.")
    assert "namespace functions {" in developer
