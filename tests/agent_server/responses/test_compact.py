"""Compaction: `POST /v1/responses/compact` (`client.responses.compact`) and `context_management`.

The model summarises the conversation; the compaction item carries the summary sealed, and a
later request that sends the compacted output instead of the history gets the summary, after the
user messages, in its prompt. On the tiny random model the summary is noise: what is checked
there is that the mechanism runs end to end on the real engine.
"""

from __future__ import annotations

import datetime
import warnings

import httpx
import openai
import pytest
from openai_harmony import Message, Role

from agent_server.harmony import PromptConfig, preamble, render_prompt
from agent_server.responses.compaction import COMPACTION_REQUEST, SUMMARY_PREFIX, summary_message
from tests.agent_server.responses.test_routes import check_stream_invariants, prompt_text, stream_events
from tests.conftest import MODEL

SUMMARY = "The user launches on Tuesday and notifies support first."
ANSWER = "<|channel|>final<|message|>Tuesday.<|return|>"
HISTORY = [
    {"role": "user", "content": "We agreed to launch on Tuesday and notify support first."},
    {"role": "assistant", "content": "Understood: Tuesday, with support told beforehand."},
]


def compact_json(client, **kwargs) -> dict:
    """The compacted response as the server sent it (the SDK parses its user messages as
    assistant ones: its output type has no input messages)."""
    raw = client.responses.with_raw_response.compact(model=MODEL, **kwargs)
    assert raw.parse().object == "response.compaction"
    return raw.http_response.json()


def test_a_compaction_is_carried_into_a_later_turn(fake_server):
    engine, client, seal = fake_server.engine, fake_server.client(), fake_server.state.seal
    engine.say(
        f"<|channel|>analysis<|message|>Summarise.<|end|><|start|>assistant<|channel|>final<|message|>"
        f"{SUMMARY}<|return|>"
    )
    compacted = compact_json(client, input=HISTORY)
    summarising = prompt_text(engine.calls[-1])
    assert COMPACTION_REQUEST in summarising and "Understood: Tuesday" in summarising
    kept, item = compacted["output"][:-1], compacted["output"][-1]
    assert [(m["type"], m["role"], m["content"][0]["text"]) for m in kept] == [
        ("message", "user", HISTORY[0]["content"])
    ]
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert SUMMARY not in item["encrypted_content"] and seal.open_summary(item["encrypted_content"]) == SUMMARY
    usage = compacted["usage"]
    assert usage["input_tokens"] == len(engine.calls[-1].request.prompt_token_ids)
    assert (
        usage["output_tokens"] == len(engine.calls[-1].generated)
        and usage["output_tokens_details"]["reasoning_tokens"] > 0
    )

    engine.say(ANSWER)
    later = client.responses.create(model=MODEL, input=[*compacted["output"], {"role": "user", "content": "When?"}])
    assert later.output_text == "Tuesday."
    text = prompt_text(engine.calls[-1])
    assert "Understood: Tuesday" not in text  # the history itself is gone ...
    assert text.index(HISTORY[0]["content"]) < text.index(SUMMARY_PREFIX + SUMMARY) < text.index("When?")
    # ... and the next turn continues the compacted conversation.
    engine.say(ANSWER)
    client.responses.create(model=MODEL, previous_response_id=later.id, input="And then?")
    assert SUMMARY in prompt_text(engine.calls[-1])


def test_the_sdk_objects_of_a_compaction_go_back_as_they_came(fake_server):
    """`input=[*compacted.output, ...]`, the SDK's own objects, as a client writes it."""
    engine, client = fake_server.engine, fake_server.client()
    first = client.responses.create(model=MODEL, input=HISTORY[0]["content"])  # (it answers "OK.")
    engine.say(f"<|channel|>final<|message|>{SUMMARY}<|return|>")
    compacted = client.responses.compact(model=MODEL, previous_response_id=first.id, input="Compact, please.")
    assert [item.type for item in compacted.output] == ["message", "message", "compaction"]
    engine.say(ANSWER)
    with warnings.catch_warnings():  # (the SDK serialising user messages it parsed as output messages)
        warnings.simplefilter("ignore")
        client.responses.create(model=MODEL, input=[*compacted.output, {"role": "user", "content": "When?"}])
    text = prompt_text(engine.calls[-1])
    assert HISTORY[0]["content"] in text and "Compact, please." in text and SUMMARY in text
    assert "OK." not in text  # the first response's answer


def test_compaction_items_are_checked(fake_server):
    client, seal = fake_server.client(), fake_server.state.seal
    for blob in ("not a blob", seal.seal("an analysis: not a summary")):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(
                model=MODEL,
                input=[{"type": "compaction", "encrypted_content": blob}, {"role": "user", "content": "Hi"}],
            )
        assert info.value.body["code"] == "invalid_encrypted_content"
        assert info.value.body["param"] == "input[0].encrypted_content"
    with pytest.raises(openai.BadRequestError) as info:  # a compaction item is no reasoning item either
        client.responses.create(
            model=MODEL, input=[{"type": "reasoning", "summary": [], "encrypted_content": seal.seal_summary("x")}]
        )
    assert info.value.body["code"] == "invalid_encrypted_content"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=[{"type": "compaction_trigger"}])
    assert info.value.body["code"] == "unsupported_value" and "/v1/responses/compact" in info.value.body["message"]


def test_compact_requests_are_checked(fake_server):
    url = f"{fake_server.url}/v1/responses/compact"
    missing = httpx.post(url, json={"input": [{"role": "user", "content": "Compact this conversation."}]})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    assert httpx.post(url, json={"model": MODEL}).json()["error"]["code"] == "missing_required_parameter"
    assert (
        httpx.post(url, json={"model": MODEL, "input": "x", "stream": True}).json()["error"]["code"]
        == "unknown_parameter"
    )
    assert (
        httpx.post(url, json={"model": MODEL, "previous_response_id": "resp_nope"}).json()["error"]["code"]
        == "previous_response_not_found"
    )
    accepted = httpx.post(url, json={"model": MODEL, "input": "x", "prompt_cache_key": "k", "service_tier": "auto"})
    assert accepted.status_code == 200


def test_context_management_compacts_before_answering(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say("<|channel|>final<|message|>" + "Tuesday it is, with support told first. " * 20 + "<|return|>")
    first = client.responses.create(model=MODEL, input=HISTORY[0]["content"])
    long_answer = first.output_text

    # Under the threshold: nothing happens.
    engine.say(ANSWER)
    quiet = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="When?",
        context_management=[{"type": "compaction", "compact_threshold": 100_000}],
    )
    assert [o.type for o in quiet.output] == ["message"] and len(engine.calls) == 2

    engine.say(f"<|channel|>final<|message|>{SUMMARY}<|return|>", ANSWER)
    events, final = stream_events(
        client,
        model=MODEL,
        previous_response_id=first.id,
        input="When?",
        context_management=[{"type": "compaction", "compact_threshold": 100}],
    )
    check_stream_invariants(events, final)
    assert [o.type for o in final.output] == ["compaction", "message"] and final.output_text == "Tuesday."
    types = [e.type for e in events]
    assert types.index("response.compaction.compacting") < types.index("response.output_text.delta")
    summarising, answering = engine.calls[-2], engine.calls[-1]
    assert COMPACTION_REQUEST in prompt_text(summarising) and long_answer in prompt_text(summarising)
    text = prompt_text(answering)
    assert long_answer not in text and text.index(SUMMARY) < text.index("When?")
    assert fake_server.state.seal.open_summary(final.output[0].encrypted_content) == SUMMARY
    assert final.usage.input_tokens == (
        len(summarising.request.prompt_token_ids) + len(answering.request.prompt_token_ids)
    )
    # Stored on the compacted conversation: the next turn does not see the history again.
    engine.say(ANSWER)
    client.responses.create(model=MODEL, previous_response_id=final.id, input="Sure?")
    assert long_answer not in prompt_text(engine.calls[-1]) and SUMMARY in prompt_text(engine.calls[-1])


def test_context_management_takes_compaction_only(fake_server):
    with pytest.raises(openai.BadRequestError) as info:
        fake_server.client().responses.create(model=MODEL, input="x", context_management=[{"type": "trim"}])
    assert info.value.body["code"] == "unsupported_value" and info.value.body["param"] == "context_management[0].type"


def test_compaction_on_the_real_engine(tiny_engine_server, monkeypatch):
    """The tiny model's summary is noise, but it is the model's: sealed, carried into a later
    turn, and what that turn's prompt holds."""
    server = tiny_engine_server
    monkeypatch.setattr(server.state.config, "default_max_output_tokens", 12)  # (a short summary)
    client = server.client()
    first = client.responses.create(model=MODEL, input=HISTORY[0]["content"], max_output_tokens=8)
    compacted = compact_json(client, previous_response_id=first.id)
    assert [o["type"] for o in compacted["output"]] == ["message", "compaction"]
    assert 0 < compacted["usage"]["output_tokens"] <= 12 and compacted["usage"]["input_tokens"] > 0
    summary = server.state.seal.open_summary(compacted["output"][-1]["encrypted_content"])

    later_input = [*compacted["output"], {"role": "user", "content": "When?"}]
    counted = client.responses.input_tokens.count(model=MODEL, input=later_input).input_tokens
    later = client.responses.create(model=MODEL, input=later_input, max_output_tokens=4)
    assert later.status in ("completed", "incomplete") and later.usage.input_tokens == counted
    head = preamble(PromptConfig(conversation_start_date=datetime.date.today().isoformat()))
    user = [Message.from_role_and_content(Role.USER, text) for text in (HISTORY[0]["content"], "When?")]
    assert counted == len(render_prompt(head + [user[0], summary_message(summary), user[1]]))
