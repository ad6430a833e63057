"""`/v1/responses` over a WebSocket, through the `openai` SDK's `client.responses.connect()`.

Several responses over one connection with the same events as SSE, store=false continuation
within the connection, cancel by message, errors as `error` events, the API key at the handshake.
"""

from __future__ import annotations

import openai
import pytest
import websockets

from tests.agent_server.responses.test_routes import prompt_text, slow_turn
from tests.conftest import MODEL, LiveServer, make_app, wait_for
from tests.fake_engine import ScriptedEngine

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
ANSWER = "<|channel|>analysis<|message|>Count.<|end|><|start|>assistant<|channel|>final<|message|>1, 2, 3.<|return|>"


def until_done(connection) -> list:
    """The events of one response (or the error event) as the connection delivers them."""
    events = []
    for event in connection:
        events.append(event)
        if event.type in TERMINAL or event.type == "error":
            return events
    raise AssertionError("the connection closed")


def test_two_responses_and_a_cancel_over_one_connection(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say(ANSWER)
    with client.responses.stream(model=MODEL, input="Count to 3.") as stream:
        sse = [event.type for event in stream]

    engine.say(ANSWER, "<|channel|>final<|message|>Three.<|return|>")
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Count to 3.", store=False)
        first = until_done(connection)
        assert [e.type for e in first] == sse  # the same events as over SSE
        assert [e.sequence_number for e in first] == list(range(len(first)))
        assert first[-1].response.output_text == "1, 2, 3."

        # store=false: the connection remembers it for previous_response_id.
        connection.response.create(
            model=MODEL, input="The last number?", store=False, previous_response_id=first[-1].response.id
        )
        second = until_done(connection)
        assert second[-1].type == "response.completed" and second[-1].response.output_text == "Three."
        assert "1, 2, 3." in prompt_text(engine.calls[-1])

        engine.token_delay = 0.01
        engine.say(slow_turn(400))
        connection.response.create(model=MODEL, input="Talk.")
        created = next(iter(connection))
        assert created.type == "response.created"
        for event in connection:
            if event.type == "response.output_text.delta":
                connection.send({"type": "response.cancel", "response_id": created.response.id})
                break
        rest = until_done(connection)
        assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"
        assert engine.calls[-1].finish_reason == "abort"
        assert client.responses.retrieve(created.response.id).status == "cancelled"  # (store=true: kept)


def test_a_prewarm_is_continued(fake_server):
    """`generate: false`, as Codex sends first: no output, nothing generated, and the next turn
    continues it with only its new input."""
    engine, client = fake_server.engine, fake_server.client()
    with client.responses.connect() as connection:
        connection.response.create(
            model=MODEL, input="You are terse.", instructions="Be brief.", store=False, generate=False
        )
        warm = until_done(connection)
        assert [e.type for e in warm] == ["response.created", "response.in_progress", "response.completed"]
        assert warm[-1].response.output == [] and not engine.calls
        connection.response.create(model=MODEL, input="Hi", store=False, previous_response_id=warm[-1].response.id)
        assert until_done(connection)[-1].response.output_text == "OK."
        text = prompt_text(engine.calls[-1])
        assert text.index("You are terse.") < text.index("Hi") and len(engine.calls) == 1


def test_lanes_errors_and_forgetting(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    with client.responses.connect() as connection:
        engine.token_delay = 0.005
        engine.say(slow_turn(30), slow_turn(30))
        connection.response.create(model=MODEL, input="a", stream_id="a", store=False)
        connection.response.create(model=MODEL, input="b", stream_id="b", store=False)
        ends, lanes = {}, set()
        for event in connection:
            lanes.add(event.stream_id)
            if event.type in TERMINAL:
                ends[event.stream_id] = event.response
                if len(ends) == 2:
                    break
        assert lanes == {"a", "b"} and all(r.status == "completed" for r in ends.values())

        for message, code in [
            ({"type": "response.create", "model": MODEL, "input": "x", "background": True}, "unsupported_parameter"),
            ({"type": "response.create", "model": MODEL, "input": "x", "temperature": "hot"}, "invalid_type"),
            ({"type": "response.steer", "input": "x", "previous_response_id": "resp_1"}, "unsupported_value"),
            ({"type": "response.cancel"}, "no_response_in_progress"),
            ({"type": "session.update"}, "invalid_value"),
        ]:
            connection.send(message)
            error = until_done(connection)[-1]
            assert error.type == "error" and error.status == 400 and error.error.code == code, error

        # A continuation that fails makes the connection forget the response it named.
        kept = ends["a"].id
        connection.response.create(
            model=MODEL,
            store=False,
            previous_response_id=kept,
            input=[{"type": "function_call_output", "call_id": "call_missing", "output": "?"}],
        )
        assert until_done(connection)[-1].error.param == "input[0].call_id"
        connection.response.create(model=MODEL, store=False, previous_response_id=kept, input="again")
        error = until_done(connection)[-1]
        assert error.status == 404 and error.error.code == "previous_response_not_found"

    # Another connection does not know the first one's store=false responses.
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, store=False, previous_response_id=ends["b"].id, input="again")
        assert until_done(connection)[-1].error.code == "previous_response_not_found"


def test_closing_the_connection_cancels_its_responses(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.token_delay = 0.01
    engine.say(slow_turn(400))
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Talk.", store=False)
        for event in connection:
            if event.type == "response.output_text.delta":
                break
    wait_for(lambda: engine.calls[-1].finish_reason == "abort")


def test_the_api_key_is_checked_at_the_handshake(tmp_path):
    engine = ScriptedEngine()
    with LiveServer(make_app(lambda: engine, tmp_path / "r.sqlite3", api_key="sesame"), api_key="sesame") as server:
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="open", max_retries=0)
        with pytest.raises(websockets.InvalidStatus) as info:
            with wrong.responses.connect():
                pass
        assert info.value.response.status_code == 401 and b"invalid_api_key" in info.value.response.body
        with server.client().responses.connect() as connection:
            connection.response.create(model=MODEL, input="Hi")
            assert until_done(connection)[-1].response.output_text == "OK."


def test_two_responses_and_a_cancel_on_the_real_engine(tiny_engine_server):
    client = tiny_engine_server.client()
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Hi", store=False, max_output_tokens=5)
        first = until_done(connection)
        assert first[0].type == "response.created" and first[-1].response.status in ("completed", "incomplete")
        connection.response.create(
            model=MODEL, input="Again", store=False, max_output_tokens=5, previous_response_id=first[-1].response.id
        )
        second = until_done(connection)
        assert second[-1].response.usage.input_tokens > first[-1].response.usage.input_tokens
        connection.response.create(model=MODEL, input="Talk at length.", max_output_tokens=500)
        for event in connection:
            assert event.type not in TERMINAL, "the model stopped before it could be cancelled"
            if event.type in ("response.output_text.delta", "response.reasoning_text.delta"):
                connection.send({"type": "response.cancel"})
                break
        rest = until_done(connection)
        assert rest[-1].response.status == "cancelled" and rest[-1].response.usage.output_tokens < 500
