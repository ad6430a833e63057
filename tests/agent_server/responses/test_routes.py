"""The Responses API against a live server, driven by the official `openai` client.

Scripted-engine tests choose what the model says (Harmony text) and check the items, the
stream and the tool loop exactly; `live_server` tests also run on the real engine over a tiny
random checkpoint, where the text is noise but every structural promise must still hold.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import httpx
import openai
import pytest

from agent_server.harmony import continuation_tokens, tool_message
from inference.tokenizer import harmony_encoding
from tests.conftest import MODEL, LiveServer, make_app, wait_for
from tests.fake_engine import ScriptedEngine, harmony_tokens

ANSWER = (
    "<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Hello! How can I help?<|return|>"
)
SEARCH = (
    "<|channel|>analysis<|message|>I should look this up.<|end|><|start|>assistant<|channel|>analysis "
    'to=browser.search <|constrain|>json<|message|>{"query": "gpt-oss license"}<|call|>'
)
CITED = "<|channel|>final<|message|>gpt-oss is Apache-2.0 licensed 【0†L1-L2】.<|return|>"
PYTHON = "<|channel|>analysis to=python code<|message|>print(6 * 7)<|call|>"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'


def stream_events(client, **kwargs):
    """All events of `client.responses.stream(...)` and the response they end with (the SDK's
    parsed final response when completed; an incomplete one is only in its terminal event)."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    return events, final


def plain(response) -> dict:
    """A response as JSON, without the SDK's client-side `parsed` additions."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "parsed"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(response.model_dump(mode="json"))


def check_stream_invariants(events, final):
    """What every stream must satisfy: numbering, item/part bookkeeping, agreement with the end."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
        "response.failed",
    )
    added = {e.output_index: e.item for e in events if e.type == "response.output_item.added"}
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(final.output)))
    for index, item in done.items():
        assert added[index].id == item.id == final.output[index].id
        assert item.type == final.output[index].type
    for e in events:
        if hasattr(e, "item_id") and hasattr(e, "output_index") and e.type != "response.output_item.added":
            assert done[e.output_index].id == e.item_id, e
    # Deltas add up to what the items end with.
    text = {}
    for e in events:
        if e.type in (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
            "response.code_interpreter_call_code.delta",
        ):
            text[(e.output_index, e.type)] = text.get((e.output_index, e.type), "") + e.delta
    for (index, kind), value in text.items():
        item = final.output[index]
        if kind == "response.function_call_arguments.delta":
            assert value == item.arguments
        elif kind == "response.code_interpreter_call_code.delta":
            assert value == item.code
        else:  # citations are resolved before text is streamed, so this holds for them too
            assert value == item.content[0].text


def prompt_text(call) -> str:
    return harmony_encoding().decode(call.request.prompt_token_ids)


# --- the plain path, on both engines -----------------------------------------------------


def test_plain_answer_with_reasoning(live_server):
    client = live_server.client()
    if live_server.kind == "fake":
        live_server.engine.say(ANSWER)
    response = client.responses.create(
        model=MODEL, input="Hi!", max_output_tokens=24, temperature=0, reasoning={"effort": "low"}
    )
    assert response.object == "response" and response.model == MODEL
    assert response.usage.output_tokens <= 24 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.reasoning.effort == "low"
    if live_server.kind == "tiny":  # noise: it rarely ends on its own, but always finishes cleanly
        assert response.status in ("completed", "incomplete")
        if response.status == "incomplete":
            assert response.incomplete_details.reason == "max_output_tokens"
            assert response.usage.output_tokens == 24
        assert response.output and all(item.status in ("completed", "incomplete") for item in response.output)
        return
    assert response.status == "completed" and response.error is None
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user greets me."
    assert message.type == "message" and message.status == "completed"
    assert response.output_text == "Hello! How can I help?"
    call = live_server.engine.calls[-1]
    assert "Reasoning: low" in prompt_text(call) and prompt_text(call).endswith("<|start|>assistant")
    assert response.usage.input_tokens == len(call.request.prompt_token_ids)
    assert response.usage.output_tokens == len(harmony_tokens(ANSWER))
    analysis = harmony_tokens("<|channel|>analysis<|message|>The user greets me.<|end|>")
    assert response.usage.output_tokens_details.reasoning_tokens == len(analysis)
    assert call.request.sampling.temperature == 0


def test_streaming_plain_answer_event_order(live_server):
    client = live_server.client()
    if live_server.kind == "fake":
        live_server.engine.say(ANSWER)
    events, final = stream_events(client, model=MODEL, input="Hi!", max_output_tokens=32, temperature=0)
    check_stream_invariants(events, final)
    assert plain(client.responses.retrieve(final.id)) == plain(final)
    if live_server.kind == "tiny":
        return
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * kinds.count("response.reasoning_text.delta"),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output_text == "Hello! How can I help?"


def test_previous_response_id_continues_the_conversation(live_server):
    client = live_server.client()
    if live_server.kind == "fake":
        live_server.engine.say(
            "<|channel|>final<|message|>Nice to meet you, Ada.<|return|>",
            "<|channel|>analysis<|message|>Name was given earlier.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Your name is Ada.<|return|>",
        )
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=32, temperature=0)
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=32, temperature=0
    )
    assert second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]
    if live_server.kind == "tiny":
        # The second prompt starts with the first conversation: the prefix cache serves it.
        assert second.usage.input_tokens > first.usage.input_tokens
        assert second.usage.input_tokens_details.cached_tokens > 0
        return
    assert second.output_text == "Your name is Ada."
    text = prompt_text(live_server.engine.calls[-1])
    assert "My name is Ada." in text and "Nice to meet you, Ada." in text and "What is my name?" in text
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_continuing_drops_finished_tool_steps_with_their_results(fake_server):
    """A turn that ended in a final answer loses its chain of thought in later prompts; a built-in
    tool call on the analysis channel goes with it, and so must the tool's answer (a tool message
    with no call before it is not Harmony the model was trained on). Every finished turn, not
    only the first."""
    engine, client = fake_server.engine, fake_server.client()
    browser = [{"type": "web_search_preview"}]
    engine.say(SEARCH, CITED)
    first = client.responses.create(model=MODEL, input="What license does gpt-oss use?", tools=browser)
    engine.say(ANSWER)
    second = client.responses.create(model=MODEL, input="Thanks!", previous_response_id=first.id, tools=browser)
    text = prompt_text(engine.calls[-1])
    assert "gpt-oss is Apache-2.0 licensed" in text and "I should look this up." not in text
    assert "to=browser.search" not in text and "<|start|>browser.search to=assistant" not in text
    engine.say(ANSWER)
    client.responses.create(model=MODEL, input="Bye.", previous_response_id=second.id, tools=browser)
    text = prompt_text(engine.calls[-1])
    assert "Hello! How can I help?" in text and "The user greets me." not in text


def test_developer_input_messages_stay_in_the_chain(fake_server):
    # Unlike the `instructions` parameter, system and developer messages in `input` are items of
    # the conversation: later responses in the chain keep them.
    engine, client = fake_server.engine, fake_server.client()
    first = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[{"role": "developer", "content": "Always answer in French."}, {"role": "user", "content": "Hi"}],
    )
    assert "Always answer in French." in prompt_text(engine.calls[-1])
    second = client.responses.create(
        model=MODEL,
        input=[{"role": "system", "content": "Use metric units."}, {"role": "user", "content": "And now?"}],
        previous_response_id=first.id,
    )
    client.responses.create(model=MODEL, input="Third", previous_response_id=second.id)
    text = prompt_text(engine.calls[-1])
    assert "Always answer in French." in text and "Use metric units." in text and "Be brief." not in text
    assert text.count("<|start|>developer") == 1


# --- built-in tools, the agent loop -----------------------------------------------------


def test_web_search_then_answer_with_citations(tool_server, fake_tools):
    engine, client = tool_server.engine, tool_server.client()
    engine.say(SEARCH, CITED)
    events, final = stream_events(
        client,
        model=MODEL,
        input="What license does gpt-oss use?",
        tools=[{"type": "web_search_preview"}],
        include=["web_search_call.action.sources"],
    )
    check_stream_invariants(events, final)
    assert [item.type for item in final.output] == ["reasoning", "web_search_call", "message"]
    search = final.output[1]
    assert search.status == "completed" and search.action.type == "search"
    assert search.action.query == "gpt-oss license"
    assert [s.url for s in search.action.sources] == ["https://example.org/oss", "https://example.org/harmony"]
    assert fake_tools["browser"].calls == [("browser.search", '{"query": "gpt-oss license"}')]
    text = final.output[2].content[0]
    assert text.text == "gpt-oss is Apache-2.0 licensed [gpt-oss release notes]."
    (citation,) = text.annotations
    assert (
        citation.url == "https://example.org/oss"
        and text.text[citation.start_index : citation.end_index] == "[gpt-oss release notes]"
    )
    kinds = [e.type for e in events]
    i = kinds.index("response.web_search_call.in_progress")
    assert kinds[i - 1] == "response.output_item.added"
    assert kinds[i + 1 : i + 4] == [
        "response.web_search_call.searching",
        "response.web_search_call.completed",
        "response.output_item.done",
    ]
    assert kinds.count("response.output_text.annotation.added") == 1
    # The model saw the tool's answer, and the continuation reused the parked sequence.
    first, second = engine.calls
    tool_text = fake_tools["browser"].sessions[0]
    expected_suffix = continuation_tokens(
        [
            tool_message(
                "browser.search",
                "# Search results for 'gpt-oss license'\n"
                "【0†gpt-oss release notes†https://example.org/oss】\n"
                "【1†The Harmony format†https://example.org/harmony】",
            )
        ]
    )
    assert second.request.continue_from == first.request.request_id and first.request.keep_alive
    assert second.request.prompt_token_ids == first.request.prompt_token_ids + first.generated + expected_suffix
    # Everything the first turn computed is reused; the last sampled token (<|call|>) was never fed
    # through the model, so it is prefilled with the tool message.
    assert second.num_cached_tokens == len(first.request.prompt_token_ids) + len(first.generated) - 1
    assert second.num_prefilled == len(expected_suffix) + 1
    assert final.usage.input_tokens_details.cached_tokens == first.num_cached_tokens + second.num_cached_tokens
    assert tool_text.closed and second.request.request_id in engine.released


def test_citation_marks_never_reach_the_user_when_nothing_was_browsed(fake_server):
    """A later turn answers from what an earlier response found, citing it the way it did there,
    without browsing again: its marks cannot be resolved (this response opened no page) and are
    removed, never shown raw."""
    engine, client = fake_server.engine, fake_server.client()
    browser = [{"type": "web_search_preview"}]
    engine.say(SEARCH, CITED)
    first = client.responses.create(model=MODEL, input="What license does gpt-oss use?", tools=browser)
    engine.say("<|channel|>final<|message|>Yes: Apache-2.0 【0†L1-L2】.<|return|>")
    events, second = stream_events(client, model=MODEL, input="Sure?", previous_response_id=first.id, tools=browser)
    check_stream_invariants(events, second)
    assert second.output_text == "Yes: Apache-2.0." and not second.output[0].content[0].annotations


def test_code_interpreter_call(tool_server, fake_tools):
    engine, client = tool_server.engine, tool_server.client()
    engine.say(PYTHON, "<|channel|>final<|message|>6 times 7 is 42.<|return|>")
    events, final = stream_events(
        client,
        model=MODEL,
        input="What is 6*7? Use python.",
        tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
        include=["code_interpreter_call.outputs"],
    )
    check_stream_invariants(events, final)
    call, message = final.output
    assert call.type == "code_interpreter_call" and call.code == "print(6 * 7)" and call.status == "completed"
    assert call.outputs[0].type == "logs" and call.outputs[0].logs == "42\n"
    assert call.container_id.startswith("cntr_")
    assert message.content[0].text == "6 times 7 is 42."
    kinds = [e.type for e in events if e.type.startswith("response.code_interpreter")]
    assert kinds[0] == "response.code_interpreter_call.in_progress"
    assert kinds[-3:] == [
        "response.code_interpreter_call_code.done",
        "response.code_interpreter_call.interpreting",
        "response.code_interpreter_call.completed",
    ]
    assert set(kinds[1:-3]) == {"response.code_interpreter_call_code.delta"}
    first, second = engine.calls
    assert second.num_prefilled == len(continuation_tokens([tool_message("python", "42\n")])) + 1
    assert "<|start|>python to=assistant<|channel|>commentary<|message|>42\n<|end|>" in prompt_text(second)


def test_tool_output_that_would_tokenize_slowly_is_cut_short(tool_server):
    # 40,000 letters in one run would hold the server for about 0.75 s of tokenizing.
    engine, client = tool_server.engine, tool_server.client()
    engine.say(
        "<|channel|>analysis to=python code<|message|>print('ok ' + 'x' * 40000)<|call|>",
        "<|channel|>final<|message|>Done.<|return|>",
    )
    final = client.responses.create(
        model=MODEL,
        input="Go",
        include=["code_interpreter_call.outputs"],
        tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
    )
    logs = final.output[0].outputs[0].logs
    assert (
        logs.startswith("ok \n[... 40001 characters left out: a run of 40000 characters")
        and final.output_text == "Done."
    )
    assert "x" * 32 not in prompt_text(engine.calls[1]) and "characters left out" in prompt_text(engine.calls[1])


def test_mcp_tools_are_listed_and_called(tool_server, fake_tools):
    engine, client = tool_server.engine, tool_server.client()
    engine.say(
        '<|channel|>commentary to=weather.get_forecast <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
        '<|channel|>commentary to=weather.get_forecast <|constrain|>json<|message|>{"city": "Atlantis"}<|call|>',
        "<|channel|>final<|message|>Sunny in Oslo.<|return|>",
    )
    events, final = stream_events(
        client,
        model=MODEL,
        input="Weather?",
        tools=[{"type": "mcp", "server_label": "weather", "require_approval": "never"}],
    )
    check_stream_invariants(events, final)
    listing, ok, failed, message = final.output
    assert listing.type == "mcp_list_tools" and [t.name for t in listing.tools] == ["get_forecast"]
    assert ok.type == "mcp_call" and ok.status == "completed" and ok.output == "Sunny in Oslo, 21°C."
    assert failed.status == "failed" and failed.error is not None and failed.output is None
    assert message.content[0].text == "Sunny in Oslo."
    kinds = [e.type for e in events]
    assert "response.mcp_list_tools.completed" in kinds and "response.mcp_call.failed" in kinds
    assert kinds.count("response.mcp_call.completed") == 1
    assert fake_tools["mcp"].calls[0] == ("weather.get_forecast", '{"city": "Oslo"}')
    # The output sent back as input (a client managing its context) replays both calls, the
    # failed one with its error object.
    engine.say("<|channel|>final<|message|>Same.<|return|>")
    replayed = client.responses.create(
        model=MODEL,
        store=False,
        input=[{"role": "user", "content": "Weather?"}, *[item.model_dump(exclude_none=True) for item in final.output]],
    )
    assert replayed.output_text == "Same."
    assert "No forecast for Atlantis." in prompt_text(engine.calls[-1])
    # The next response in the conversation does not list the tools again.
    engine.say("<|channel|>final<|message|>Still sunny.<|return|>")
    again = client.responses.create(
        model=MODEL,
        input="And now?",
        previous_response_id=final.id,
        tools=[{"type": "mcp", "server_label": "weather", "require_approval": "never"}],
    )
    assert [item.type for item in again.output] == ["message"]
    # ... nor the one after it: the listing is still in the chain's context.
    engine.say("<|channel|>final<|message|>Sunny still.<|return|>")
    third = client.responses.create(
        model=MODEL,
        input="Later?",
        previous_response_id=again.id,
        tools=[{"type": "mcp", "server_label": "weather", "require_approval": "never"}],
    )
    assert [item.type for item in third.output] == ["message"]


def test_function_call_and_its_output(tool_server):
    engine, client = tool_server.engine, tool_server.client()
    engine.say("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + WEATHER_CALL)
    events, first = stream_events(client, model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL])
    check_stream_invariants(events, first)
    assert first.status == "completed"
    reasoning, call = first.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert [e.type for e in events].count("response.function_call_arguments.done") == 1
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in prompt_text(engine.calls[0])
    assert not engine.calls[0].request.keep_alive  # nothing server-side to continue

    engine.say("<|channel|>final<|message|>It is 21°C and clear in Paris.<|return|>")
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}],
    )
    assert second.output_text == "It is 21°C and clear in Paris."
    text = prompt_text(engine.calls[-1])
    assert "to=functions.get_weather" in text
    assert text.endswith(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"temperature_c": 21}<|end|><|start|>assistant'
    )

    # The same continuation with the client managing the context itself.
    engine.say("<|channel|>final<|message|>21°C.<|return|>")
    manual = client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "21"},
        ],
    )
    assert manual.output_text == "21°C."
    assert prompt_text(engine.calls[-1]).endswith(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>21<|end|><|start|>assistant"
    )


def test_a_turn_with_a_function_call_and_a_builtin_call_ends_for_the_client(fake_server):
    """The model chains a client function call and a python call in one turn: the server runs
    python, then the response ends so that the client can run its function (the model has not
    seen its output). It does not answer on, leaving a completed function_call nobody answered."""
    engine, client = fake_server.engine, fake_server.client()
    tools = [WEATHER_TOOL, {"type": "code_interpreter", "container": {"type": "auto"}}]
    engine.say(WEATHER_CALL.replace("<|call|>", "<|end|>") + "<|start|>assistant" + PYTHON)
    first = client.responses.create(model=MODEL, input="Weather in Paris, and 6*7?", tools=tools)
    assert [item.type for item in first.output] == ["function_call", "code_interpreter_call"]
    assert first.output[1].status == "completed" and len(engine.calls) == 1
    engine.say("<|channel|>final<|message|>21°C, and 42.<|return|>")
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": first.output[0].call_id, "output": "21"}],
    )
    assert second.output_text == "21°C, and 42."
    assert prompt_text(engine.calls[-1]).endswith(
        "<|start|>python to=assistant<|channel|>commentary<|message|>42\n<|end|>"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>21<|end|><|start|>assistant"
    )


def test_a_call_nobody_answered_is_not_replayed(fake_server):
    """A call the token limit cut short, or one to a tool that does not exist, never gets an
    answer: continuing the chain must not show the model a call with no tool message after it
    (a cut call even ends in <|call|> as if complete)."""
    engine, client = fake_server.engine, fake_server.client()
    engine.say("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant" + WEATHER_CALL)
    cut = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER_TOOL], max_output_tokens=22)
    assert cut.status == "incomplete" and cut.output[-1].type == "function_call"
    engine.say(ANSWER)
    client.responses.create(model=MODEL, input="Go on.", previous_response_id=cut.id, tools=[WEATHER_TOOL])
    text = prompt_text(engine.calls[-1])
    assert "Need weather." in text and "to=functions.get_weather" not in text
    engine.say('<|channel|>analysis to=container.exec <|constrain|>json<|message|>{"cmd": "ls"}<|call|>')
    unknown = client.responses.create(model=MODEL, input="List files.")
    assert unknown.output[-1].status == "incomplete"
    engine.say(ANSWER)
    client.responses.create(model=MODEL, input="Go on.", previous_response_id=unknown.id)
    assert "to=container.exec" not in prompt_text(engine.calls[-1])


def test_limits_make_responses_incomplete_or_stop_tools(tool_server, fake_tools):
    engine, client = tool_server.engine, tool_server.client()
    engine.say(ANSWER)
    short = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 5 and short.output[0].status == "incomplete"
    # Cut inside the final message's header: the reasoning, and no item of Harmony markup.
    cut = len(
        harmony_tokens("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final")
    )
    engine.say(ANSWER)
    events, cut_short = stream_events(client, model=MODEL, input="Hi", max_output_tokens=cut)
    check_stream_invariants(events, cut_short)
    assert cut_short.status == "incomplete" and cut_short.usage.output_tokens == cut
    assert [o.type for o in cut_short.output] == ["reasoning"]
    engine.say(ANSWER)
    again = client.responses.create(model=MODEL, input="And?", previous_response_id=cut_short.id)
    assert "<|channel|>final<|end|>" not in prompt_text(engine.calls[-1]) and again.status == "completed"

    engine.say(PYTHON, PYTHON, "<|channel|>final<|message|>Done.<|return|>")
    limited = client.responses.create(
        model=MODEL,
        input="Compute twice",
        max_tool_calls=1,
        tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
    )
    assert [o.status for o in limited.output] == ["completed", "failed", "completed"]
    assert len(fake_tools["python"].calls) == 1
    assert "limit of 1 tool calls" in prompt_text(engine.calls[-1])


def test_malformed_harmony_never_fails_the_response(tool_server):
    engine, client = tool_server.engine, tool_server.client()
    engine.say("<|channel|>final<|message|>Partly fine.<|end|>then garbage<|return|>")
    response = client.responses.create(model=MODEL, input="Hi")
    assert response.status == "completed"
    good, bad = response.output
    assert good.status == "completed" and good.content[0].text == "Partly fine."
    assert bad.status == "incomplete" and bad.content[0].text == "then garbage"

    engine.say('<|channel|>commentary to=nowhere.tool <|constrain|>json<|message|>{"a": 1}<|call|>')
    events, response = stream_events(client, model=MODEL, input="Hi")
    check_stream_invariants(events, response)
    assert response.status == "completed"
    assert response.output[0].type == "message" and response.output[0].status == "incomplete"
    assert response.output[0].content[0].text == '{"a": 1}'


# --- storage, background, errors ----------------------------------------------------------


def test_retrieve_delete_and_input_items(fake_server):
    client = fake_server.client()
    response = client.responses.create(
        model=MODEL,
        metadata={"topic": "test"},
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "One"}]},
            {"role": "assistant", "content": "Two"},
            {"role": "user", "content": "Three"},
        ],
    )
    assert "Be brief." in prompt_text(fake_server.engine.calls[-1])
    got = client.responses.retrieve(response.id)
    assert got.model_dump() == response.model_dump() and got.metadata == {"topic": "test"}
    items = client.responses.input_items.list(response.id, order="asc")
    texts = [i.content[0].text for i in items.data]
    assert texts == ["Be brief.", "One", "Two", "Three"]
    page = client.responses.input_items.list(response.id, limit=2, order="asc", after=items.data[0].id)
    assert [i.content[0].text for i in page.data] == ["One", "Two"] and page.has_more
    assert client.responses.delete(response.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)

    unstored = client.responses.create(model=MODEL, input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stored_responses_survive_a_restart(tmp_path):
    store = tmp_path / "responses.sqlite3"
    engine = ScriptedEngine().say(ANSWER)
    with LiveServer(make_app(lambda: engine, store)) as server:
        first = server.client().responses.create(model=MODEL, input="Hi")
    engine = ScriptedEngine().say("<|channel|>final<|message|>Welcome back.<|return|>")
    with LiveServer(make_app(lambda: engine, store)) as server:
        client = server.client()
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        second = client.responses.create(model=MODEL, input="Again", previous_response_id=first.id)
        assert "Hello! How can I help?" in prompt_text(engine.calls[0]) and second.output_text == "Welcome back."
    # A store written before the item index existed gets one when it is opened.
    with sqlite3.connect(store) as db:
        db.execute("DROP TABLE response_items")
    engine = ScriptedEngine().say(ANSWER)
    with LiveServer(make_app(lambda: engine, store)) as server:
        server.client().responses.create(model=MODEL, input=[{"type": "item_reference", "id": first.output[-1].id}])
        assert "Hello! How can I help?" in prompt_text(engine.calls[0])


def test_items_are_referenced_by_id(tool_server, fake_tools):
    engine, client = tool_server.engine, tool_server.client()
    engine.say(SEARCH, CITED)
    searched = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "License?", "id": "msg_q"}],
        tools=[{"type": "web_search_preview"}],
    )
    reasoning, search, answer = searched.output
    engine.say(WEATHER_CALL)
    called = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER_TOOL])
    call = called.output[-1]
    # A context built from references (as the Vercel AI SDK and Codex send it) is the items themselves.
    engine.say(ANSWER)
    refs = [{"type": "item_reference", "id": i} for i in ("msg_q", reasoning.id, search.id, answer.id, call.id)]
    referenced = client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        input=[*refs, {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
    )
    text = prompt_text(engine.calls[-1])
    for piece in ("License?", "Apache-2.0 licensed", "to=functions.get_weather", "Sunny"):
        assert piece in text, piece
    assert "I should look this up." not in text  # the reasoning of a turn that ended in its answer
    listed = client.responses.input_items.list(referenced.id, order="asc").data
    assert [i.id for i in listed[:5]] == [r["id"] for r in refs] and listed[3].type == "message"

    def refused(item_id, index=0) -> dict:
        r = httpx.post(
            f"{tool_server.url}/v1/responses",
            json={
                "model": MODEL,
                "input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": item_id}][1 - index :],
            },
        )
        assert r.status_code == 404, r.text
        return r.json()["error"]

    assert refused("msg_nowhere")["param"] == "input[0].id"
    # An id several responses hold (a client that keeps an edited message's id): the newest.
    for n in range(4):
        engine.say(ANSWER)
        client.responses.create(model=MODEL, input=[{"role": "user", "content": f"version {n}", "id": "msg_edit"}])
    engine.say(ANSWER)
    client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_edit"}])
    assert "version 3" in prompt_text(engine.calls[-1])
    engine.say(ANSWER)
    gone = client.responses.create(model=MODEL, input="Hi")
    client.responses.delete(gone.id)
    assert refused(gone.output[-1].id, index=1)["param"] == "input[1].id"  # deleted with its response
    # The items referenced belong to the new response too: deleting either leaves the other's.
    engine.say(ANSWER)
    again = client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": answer.id}])
    client.responses.delete(again.id)
    engine.say(ANSWER)
    client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": answer.id}])
    assert "Apache-2.0 licensed" in prompt_text(engine.calls[-1])
    client.responses.delete(searched.id)
    engine.say(ANSWER)
    client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": answer.id}])
    assert "Apache-2.0 licensed" in prompt_text(engine.calls[-1])


def slow_turn(words: int) -> str:
    return "<|channel|>final<|message|>" + " word" * words + "<|return|>"


def test_background_responses_poll_resume_and_cancel(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.token_delay = 0.005
    engine.say(slow_turn(40))
    queued = client.responses.create(model=MODEL, input="Write", background=True)
    assert queued.status == "queued" and queued.background
    wait_for(lambda: client.responses.retrieve(queued.id).status == "completed")
    done = client.responses.retrieve(queued.id)
    assert done.output_text == " word" * 40

    # The stored stream replays from any point, response.queued included.
    events = list(client.responses.retrieve(queued.id, stream=True, starting_after=-1))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
    ]
    tail = list(client.responses.retrieve(queued.id, stream=True, starting_after=10))
    assert [e.sequence_number for e in tail] == list(range(11, len(events)))
    assert tail[-1].type == "response.completed"

    engine.token_delay = 0.05
    engine.say(slow_turn(400))
    running = client.responses.create(model=MODEL, input="Write a lot", background=True)
    wait_for(lambda: len(engine.calls) == 2 and len(engine.calls[-1].generated) > 3)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    wait_for(lambda: engine.running == 0)
    assert engine.calls[-1].finish_reason == "abort" and len(engine.calls[-1].generated) < 400

    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model=MODEL, input="x").id)


def test_background_stream_resumes_after_the_client_leaves(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.token_delay = 0.01
    engine.say(slow_turn(60))
    seen = []
    with client.responses.create(model=MODEL, input="Write", background=True, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 8:
                break
    rest = list(client.responses.retrieve(seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number))
    assert rest[0].sequence_number == seen[-1].sequence_number + 1 and rest[-1].type == "response.completed"
    assert rest[-1].response.output_text == " word" * 60


def test_disconnect_mid_stream_stops_generation_and_keeps_the_response(fake_server):
    engine = fake_server.engine
    engine.token_delay = 0.02
    engine.say(slow_turn(500))
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "Write", "stream": True}
        ) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) > 20:
                    break
    wait_for(lambda: engine.running == 0)
    call = engine.calls[-1]
    assert call.finish_reason == "abort" and len(call.generated) < 500
    created = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
    stored = fake_server.client().responses.retrieve(created["response"]["id"])
    assert stored.status == "cancelled" and stored.output[0].status == "incomplete"
    assert stored.output[0].content[0].text.startswith(" word")


def test_disconnect_while_waiting_stops_generation(fake_server):
    engine = fake_server.engine
    engine.token_delay = 0.02
    engine.say(slow_turn(500))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "Write"}, timeout=0.5)
    wait_for(lambda: engine.running == 0)
    assert engine.calls[-1].finish_reason == "abort" and len(engine.calls[-1].generated) < 500


def test_oversized_bodies_are_refused(tmp_path):
    with LiveServer(make_app(ScriptedEngine, tmp_path / "r.db", max_request_bytes=1000)) as server:
        r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_bad_requests_get_openai_errors(fake_server):
    client = fake_server.client()
    url = f"{fake_server.url}/v1/responses"

    def error(body, status=400, **kwargs):
        r = (
            httpx.post(url, json=body, **kwargs)
            if body is not None
            else httpx.post(url, content=b"{oops", headers={"Content-Type": "application/json"}, **kwargs)
        )
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return err

    assert error({"model": MODEL, "input": "x", "temperature": 9})["param"] == "temperature"
    assert error({"model": MODEL, "input": "x", "bogus": 1})["code"] == "unknown_parameter"
    assert error({"input": "x"})["param"] == "model"
    assert error({"model": MODEL})["param"] == "input"
    assert error({"model": "other-model", "input": "x"}, 404)["param"] == "model"
    assert error(None)["code"] == "invalid_json"
    assert (
        error({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})[
            "param"
        ]
        == "input[0].content[0]"
    )
    assert (
        error(
            {
                "model": MODEL,
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}},
            }
        )["param"]
        == "text.format.schema"
    )
    assert error({"model": MODEL, "input": "x", "include": ["reasoning.everything"]})["param"] == "include[0]"
    assert (
        error({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, 404)["param"]
        == "previous_response_id"
    )
    assert (
        error({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]})["param"]
        == "input[0].call_id"
    )
    assert (
        error(
            {"model": MODEL, "input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}
        )["param"]
        == "tool_choice"
    )
    assert error({"model": MODEL, "input": "x", "background": True, "store": False})["param"] == "background"
    assert (
        error({"model": MODEL, "input": "x", "tools": [{"type": "mcp", "server_label": "nope"}]})["param"]
        == "tools[0].server_label"
    )
    assert error({"model": MODEL, "input": "hello " * 9000}, 400)["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", max_output_tokens=0)
    assert info.value.body["param"] == "max_output_tokens"


@pytest.mark.parametrize(
    "name",
    [
        "store",
        "background",
        "stream",
        "parallel_tool_calls",
        "tools",
        "tool_choice",
        "top_logprobs",
        "conversation",
        "prompt",
        "truncation",
    ],
)
def test_an_explicit_null_means_not_given(fake_server, name):
    # The SDK sends None as null for the parameters it types Optional.
    r = httpx.post(f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "x", name: None})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed" and body["background"] is False
    assert httpx.get(f"{fake_server.url}/v1/responses/{body['id']}").status_code == 200  # stored
    assert body["parallel_tool_calls"] is True and body["tools"] == [] and body["tool_choice"] == "auto"
    response = fake_server.client().responses.create(
        model=MODEL, input="x", store=None, parallel_tool_calls=None, background=None
    )
    assert response.status == "completed" and response.parallel_tool_calls is True


def test_requests_openai_refuses_are_refused(fake_server):
    engine, client = fake_server.engine, fake_server.client()

    def refused(body) -> dict:
        r = httpx.post(f"{fake_server.url}/v1/responses", json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    # Duplicate input item ids: /input_items pages by id.
    same = [{"type": "message", "role": "user", "content": f"m{i}", "id": "msg_same"} for i in range(3)]
    assert refused({"input": same})["param"] == "input[1].id"
    distinct = client.responses.create(model=MODEL, input=[{**m, "id": f"msg_{i}"} for i, m in enumerate(same)])
    listed = [item.id for item in client.responses.input_items.list(distinct.id, limit=1, order="asc")]
    assert listed == ["msg_0", "msg_1", "msg_2"]
    # tool_choice "required" with no tools; a tool choice type the Response cannot hold.
    assert refused({"input": "x", "tool_choice": "required"})["param"] == "tool_choice"
    error = refused({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}})
    assert error["param"] == "tool_choice.type" and "web_search_preview" in error["message"]
    mcp = {"type": "mcp", "server_label": "weather", "require_approval": "never"}
    error = refused(
        {
            "input": "x",
            "tools": [mcp],
            "tool_choice": {"type": "mcp", "server_label": "weather", "name": "get_horoscope"},
        }
    )
    assert error["param"] == "tool_choice.name" and "get_horoscope" in error["message"]
    chosen = client.responses.create(
        model=MODEL,
        input="x",
        tools=[mcp],
        tool_choice={"type": "mcp", "server_label": "weather", "name": "get_forecast"},
    )
    grammar = engine.calls[-1].request.sampling.grammar.text  # the turn grammar forces that tool
    assert grammar.startswith("start: call_0\n") and "to=weather.get_forecast " in grammar and "call_1" not in grammar
    assert chosen.status == "completed"
    # A response that ended in function calls continues with their outputs.
    engine.say(WEATHER_CALL)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL])
    call = first.output[-1]
    assert call.type == "function_call"
    error = refused({"input": "hello", "previous_response_id": first.id, "tools": [WEATHER_TOOL]})
    assert call.call_id in error["message"] and error["param"] == "input"
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
    )
    assert answered.status == "completed"
    # A call the token limit cut short needs no output: nobody could run it.
    engine.say(WEATHER_CALL)
    cut = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER_TOOL], max_output_tokens=12)
    assert cut.status == "incomplete" and cut.output[-1].type == "function_call"
    assert cut.output[-1].status == "incomplete"
    engine.say(ANSWER)
    assert (
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=cut.id, tools=[WEATHER_TOOL]).status
        == "completed"
    )


def test_listed_input_items_are_the_sdk_types_strictly(fake_server):
    from openai.types.responses import ResponseItem
    from pydantic import TypeAdapter

    client = fake_server.client()
    response = client.responses.create(
        model=MODEL,
        input=[
            {"role": "assistant", "content": "Two"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Three", "annotations": []}]},
            {"role": "user", "content": "x"},
        ],
    )
    items = httpx.get(f"{fake_server.url}/v1/responses/{response.id}/input_items?order=asc").json()["data"]
    for item in items:
        TypeAdapter(ResponseItem).validate_python(item, strict=True)


def test_request_identifiers_are_echoed(fake_server):
    response = fake_server.client().responses.create(
        model=MODEL, input="x", prompt_cache_key="k1", safety_identifier="user-7", service_tier="flex"
    )
    assert (response.prompt_cache_key, response.safety_identifier) == ("k1", "user-7")
    assert response.service_tier == "default"  # what processed it
    stored = fake_server.client().responses.retrieve(response.id)
    assert stored.prompt_cache_key == "k1" and stored.safety_identifier == "user-7"


def test_mcp_headers_are_neither_echoed_nor_stored(fake_server):
    secret = "Bearer sk-very-secret"
    tool = {"type": "mcp", "server_label": "weather", "require_approval": "never", "headers": {"Authorization": secret}}
    r = httpx.post(f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "x", "tools": [tool]})
    assert r.status_code == 200 and secret not in r.text
    assert secret not in httpx.get(f"{fake_server.url}/v1/responses/{r.json()['id']}").text
    store = fake_server.state.config.store_path
    written = [f.read_bytes() for f in store.parent.glob(store.name + "*")]  # the database and its WAL
    assert written and not any(secret.encode() in data for data in written)


def test_tools_the_server_lacks_are_refused(tmp_path):
    with LiveServer(make_app(ScriptedEngine, tmp_path / "r.db")) as server:
        with pytest.raises(openai.BadRequestError) as info:
            server.client().responses.create(model=MODEL, input="x", tools=[{"type": "web_search_preview"}])
    assert info.value.body["param"] == "tools[0]" and info.value.body["code"] == "tool_not_available"


def slow_store_puts(server, seconds: float) -> None:
    """Make every store write of `server` take `seconds` longer: the window in which a response
    has published an event but not yet been stored."""
    store = server.state.store
    put = store.put

    async def slow_put(record):
        await asyncio.sleep(seconds)
        await put(record)

    store.put = slow_put


def test_a_response_continues_as_soon_as_its_last_event_is_out(fake_server):
    slow_store_puts(fake_server, 0.3)
    client = fake_server.client()
    with client.responses.create(model=MODEL, input="hi", stream=True) as stream:
        last = [e for e in stream][-1]
    assert last.type == "response.completed"
    follow = client.responses.create(model=MODEL, input="more", previous_response_id=last.response.id)
    assert follow.status == "completed"

    queued = client.responses.create(model=MODEL, input="hi", background=True)
    wait_for(lambda: client.responses.retrieve(queued.id).status == "completed")
    assert client.responses.create(model=MODEL, input="more", previous_response_id=queued.id).status == "completed"


def test_cancel_or_delete_before_a_background_response_starts(fake_server):
    slow_store_puts(fake_server, 0.3)
    engine, client = fake_server.engine, fake_server.client()
    engine.token_delay = 0.01
    engine.say(slow_turn(300))
    queued = client.responses.create(model=MODEL, input="Write", background=True)
    cancelled = client.responses.cancel(queued.id)  # while its first store write runs
    assert cancelled.status == "cancelled" and not engine.calls
    assert client.responses.retrieve(queued.id).status == "cancelled"

    queued = client.responses.create(model=MODEL, input="Write", background=True)
    deleted = httpx.delete(f"{fake_server.url}/v1/responses/{queued.id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert httpx.get(f"{fake_server.url}/v1/responses/{queued.id}").status_code == 404
    wait_for(lambda: not fake_server.state.runs.runs)
    time.sleep(0.4)  # past any store write still under way
    assert httpx.get(f"{fake_server.url}/v1/responses/{queued.id}").status_code == 404
    assert not engine.calls


def test_a_response_deleted_while_it_is_stored_stays_deleted(fake_server):
    slow_store_puts(fake_server, 0.5)
    client = fake_server.client()
    with client.responses.create(model=MODEL, input="hi", stream=True) as stream:
        done = next(e for e in stream if e.type == "response.completed")  # the stream ends once it is stored
    deleted = httpx.delete(f"{fake_server.url}/v1/responses/{done.response.id}")  # during its final store write
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    wait_for(lambda: not fake_server.state.runs.runs)
    assert httpx.get(f"{fake_server.url}/v1/responses/{done.response.id}").status_code == 404


def test_items_already_in_the_previous_chain_are_refused_as_duplicates(fake_server):
    # OpenAI: "Duplicate item found with id ..." when an item of the previous_response_id chain is
    # sent again (whole, or by item_reference); the model must not see it twice.
    engine, client = fake_server.engine, fake_server.client()
    engine.say(WEATHER_CALL)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL])
    call = first.output[-1]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}

    def refused(items) -> dict:
        r = httpx.post(
            f"{fake_server.url}/v1/responses",
            json={"model": MODEL, "previous_response_id": first.id, "tools": [WEATHER_TOOL], "input": items},
        )
        assert r.status_code == 400, r.text
        return r.json()["error"]

    resent = [o.model_dump(mode="json", exclude_none=True) for o in first.output]
    error = refused([*resent, output])
    assert call.id in error["message"] or resent[0]["id"] in error["message"]
    assert error["param"].startswith("input[")
    assert refused([{"type": "item_reference", "id": call.id}, output])["param"] == "input[0].id"
    engine.say(ANSWER)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL], input=[output])
    assert prompt_text(engine.calls[-1]).count("to=functions.get_weather") == 1
    # Further down the chain too (the first response's input item and call).
    first_input = client.responses.input_items.list(first.id).data[0]
    r = httpx.post(
        f"{fake_server.url}/v1/responses",
        json={
            "model": MODEL,
            "previous_response_id": second.id,
            "input": [{"type": "item_reference", "id": first_input.id}],
        },
    )
    assert r.status_code == 400 and first_input.id in r.json()["error"]["message"]


def test_a_background_stream_cut_by_a_restart_still_ends(tmp_path):
    # The server stopped while a background response ran: its stored stream has no terminal event.
    # Resuming it must still end with one (the SDK and OpenAI's streams always do), not just stop.
    store = tmp_path / "responses.sqlite3"
    engine = ScriptedEngine(token_delay=0.02).say(slow_turn(500))
    server = LiveServer(make_app(lambda: engine, store, shutdown_timeout=0.1)).start()
    try:
        queued = server.client().responses.create(model=MODEL, input="Write", background=True)
        wait_for(lambda: engine.calls and len(engine.calls[-1].generated) > 3)
        with sqlite3.connect(store) as db:  # what a crash leaves: the record as first stored
            assert (
                json.loads(db.execute("SELECT record FROM responses").fetchone()[0])["response"]["status"] == "queued"
            )
            crashed = tmp_path / "crashed.sqlite3"
            with sqlite3.connect(crashed) as copy:
                db.backup(copy)
    finally:
        server.stop()
    with LiveServer(make_app(ScriptedEngine, crashed)) as server:
        client = server.client()
        assert client.responses.retrieve(queued.id).status == "failed"
        for starting_after in (-1, 5):
            events = list(client.responses.retrieve(queued.id, stream=True, starting_after=starting_after))
            assert events and events[-1].type == "response.failed", events
            assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
            assert events[-1].sequence_number > starting_after


def test_truncation_auto_drops_the_oldest_items_to_fit(tmp_path):
    # OpenAI: truncation="auto" drops items from the beginning of the conversation when the input
    # exceeds the context window; "disabled" (the default) fails with a 400.
    engine = ScriptedEngine(max_model_len=320)
    with LiveServer(make_app(lambda: engine, tmp_path / "r.db")) as server:
        client = server.client()
        engine.say("<|channel|>final<|message|>Noted.<|return|>")
        first = client.responses.create(model=MODEL, input="alpha " * 120)
        long_turn = dict(model=MODEL, input="omega " * 120, previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**long_turn)
        assert info.value.body["code"] == "context_length_exceeded"
        engine.say("<|channel|>final<|message|>Fine.<|return|>")
        cut = client.responses.create(**long_turn, truncation="auto", max_output_tokens=16)
        assert cut.status == "completed" and cut.truncation == "auto" and cut.output_text == "Fine."
        prompt = prompt_text(engine.calls[-1])
        assert "alpha" not in prompt and "omega" in prompt and prompt.endswith("<|start|>assistant")
        assert client.responses.retrieve(cut.id).truncation == "auto"
        with pytest.raises(openai.BadRequestError) as info:  # the newest input alone does not fit
            client.responses.create(model=MODEL, input="omega " * 400, truncation="auto")
        # ... and the 400 says why truncation could not help (it said only the sizes).
        assert "truncation='auto' could not help" in info.value.body["message"]
        assert "single turn" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="omega " * 400, previous_response_id=first.id, truncation="auto")
        assert "dropped every earlier turn, but the last one on its own" in info.value.body["message"]


def test_opening_the_store_reads_only_unfinished_responses(tmp_path, monkeypatch):
    # Startup marks responses that were running as failed. It must not load and parse every
    # record (whole event logs of background responses included): startup time and memory would
    # grow with the store, without bound.
    import agent_server.store as store_module
    from agent_server.store import SQLiteResponseStore, StoredResponse

    path = tmp_path / "responses.sqlite3"
    store = SQLiteResponseStore(path)
    for i in range(20):
        store._put(
            StoredResponse(
                id=f"resp_done{i}",
                response={
                    "id": f"resp_done{i}",
                    "status": "completed",
                    "output": [{"id": f"msg_{i}", "type": "message"}],
                },
                input_items=[],
                events=[{"type": "response.created", "sequence_number": 0}],
            )
        )
    store._put(
        StoredResponse(
            id="resp_running",
            response={"id": "resp_running", "status": "in_progress", "output": []},
            input_items=[],
            events=[],
        )
    )
    asyncio.run(store.close())
    parsed = []
    loads = json.loads
    monkeypatch.setattr(store_module.json, "loads", lambda raw, *a, **k: parsed.append(raw) or loads(raw, *a, **k))
    reopened = SQLiteResponseStore(path)
    assert len(parsed) == 1  # the running one only
    monkeypatch.undo()
    assert asyncio.run(reopened.get("resp_running")).status == "failed"
    assert asyncio.run(reopened.get("resp_done3")).status == "completed"
    assert asyncio.run(reopened.find_item("msg_3"))["id"] == "msg_3"
    asyncio.run(reopened.close())


def test_a_store_from_before_the_status_column_is_migrated(tmp_path):
    # The old table: no status column. Opening it fills the column in (its running response is
    # then marked failed, as any left running), and new writes keep it.
    from agent_server.store import SQLiteResponseStore

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL, record TEXT NOT NULL)")
        for rid, status in (("resp_old_done", "completed"), ("resp_old_running", "in_progress")):
            record = {"id": rid, "response": {"id": rid, "status": status, "output": []}, "input_items": []}
            db.execute("INSERT INTO responses VALUES (?, 0, ?)", (rid, json.dumps(record)))
    store = SQLiteResponseStore(path)
    assert asyncio.run(store.get("resp_old_running")).status == "failed"
    assert asyncio.run(store.get("resp_old_done")).status == "completed"
    asyncio.run(store.close())
    with sqlite3.connect(path) as db:
        assert dict(db.execute("SELECT id, status FROM responses")) == {
            "resp_old_done": "completed",
            "resp_old_running": "failed",
        }


def test_function_outputs_follow_the_order_of_their_calls(fake_server):
    # Harmony has no call ids: the model pairs results with calls by their order, so outputs sent
    # back in another order go into the prompt in the calls' order.
    engine, client = fake_server.engine, fake_server.client()
    rome = WEATHER_CALL.replace("Paris", "Rome")
    engine.say(WEATHER_CALL.replace("<|call|>", "<|end|>") + "<|start|>assistant" + rome)
    first = client.responses.create(model=MODEL, input="Weather in Paris and Rome?", tools=[WEATHER_TOOL])
    paris, rome_call = first.output
    engine.say(ANSWER)
    client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],
        input=[
            {"type": "function_call_output", "call_id": rome_call.call_id, "output": "RAIN_ROME"},
            {"type": "function_call_output", "call_id": paris.call_id, "output": "SUN_PARIS"},
        ],
    )
    text = prompt_text(engine.calls[-1])
    assert text.index('"Paris"') < text.index('"Rome"') < text.index("SUN_PARIS") < text.index("RAIN_ROME")
    # The same when the client sends the whole context itself.
    engine.say(ANSWER)
    calls = [p.model_dump(mode="json", exclude_none=True) for p in (paris, rome_call)]
    client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather?"},
            *[{k: c[k] for k in ("type", "call_id", "name", "arguments")} for c in calls],
            {"type": "function_call_output", "call_id": rome_call.call_id, "output": "RAIN_ROME"},
            {"type": "function_call_output", "call_id": paris.call_id, "output": "SUN_PARIS"},
        ],
    )
    text = prompt_text(engine.calls[-1])
    assert text.index('"Paris"') < text.index('"Rome"') < text.index("SUN_PARIS") < text.index("RAIN_ROME")
