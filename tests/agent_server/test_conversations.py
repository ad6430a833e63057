"""`/v1/conversations` (`client.conversations`) and `responses.create(conversation=...)`.

A conversation keeps Responses items in the store beside responses: a response in it reads its
items before its own input and adds its input and output items to it, across server restarts.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from agent_server.harmony import assistant_start_tokens
from tests.agent_server.responses.test_routes import prompt_text
from tests.conftest import MODEL, LiveServer, make_app
from tests.fake_engine import ScriptedEngine

ANSWER = (
    "<|channel|>analysis<|message|>Her name was given.<|end|><|start|>assistant<|channel|>final<|message|>"
    "You are Ada.<|return|>"
)


@pytest.fixture
def fake_server(tmp_path, fake_engine, fake_tools, store_url):
    """conftest's `fake_server` on each store backend."""
    app = make_app(lambda: fake_engine, tmp_path / "responses.sqlite3", tools=fake_tools.values(), store_url=store_url)
    with LiveServer(app, kind="fake") as server:
        yield server


def test_conversations_and_their_items(fake_server):
    client = fake_server.client()
    conversation = client.conversations.create(
        items=[{"role": "user", "content": "My name is Ada."}], metadata={"topic": "names"}
    )
    assert conversation.object == "conversation" and conversation.id.startswith("conv_")
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": "names"}
    assert client.conversations.update(conversation.id, metadata={"topic": "people"}).metadata == {"topic": "people"}

    added = client.conversations.items.create(
        conversation.id,
        items=[
            {"type": "message", "role": "assistant", "content": "Hello, Ada."},
            {"type": "message", "role": "user", "content": "What is my name?"},
        ],
    )
    assert [item.role for item in added.data] == ["assistant", "user"] and not added.has_more
    assert added.first_id == added.data[0].id and added.last_id == added.data[1].id

    newest_first = client.conversations.items.list(conversation.id)
    assert [item.content[0].text for item in newest_first.data] == [
        "What is my name?",
        "Hello, Ada.",
        "My name is Ada.",
    ]
    page = client.conversations.items.list(conversation.id, order="asc", limit=2)
    assert [item.role for item in page.data] == ["user", "assistant"] and page.has_more
    rest = client.conversations.items.list(conversation.id, order="asc", after=page.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["What is my name?"] and not rest.has_more
    every = list(client.conversations.items.list(conversation.id, order="asc", limit=1))  # the SDK pages on
    assert [item.id for item in every] == [*[item.id for item in page.data], rest.data[0].id]

    hello = page.data[1]
    assert (
        client.conversations.items.retrieve(hello.id, conversation_id=conversation.id).content[0].text == "Hello, Ada."
    )
    assert client.conversations.items.delete(hello.id, conversation_id=conversation.id).id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(hello.id, conversation_id=conversation.id)
    assert len(client.conversations.items.list(conversation.id).data) == 2

    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.object == "conversation.deleted"
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conversation.id)


def test_bad_conversation_requests(fake_server):
    client, url = fake_server.client(), f"{fake_server.url}/v1/conversations"
    with pytest.raises(openai.BadRequestError) as info:
        client.conversations.create(items=[{"role": "user", "content": "x"}] * 21)
    assert info.value.body["param"] == "items"
    with pytest.raises(openai.BadRequestError) as info:
        client.conversations.create(metadata={"k" * 65: "v"})
    assert info.value.body["param"] == "metadata"
    conversation = client.conversations.create(items=[{"id": "msg_1", "role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:  # an item id it holds already
        client.conversations.items.create(conversation.id, items=[{"id": "msg_1", "role": "user", "content": "y"}])
    assert info.value.body["param"] == "items"
    assert httpx.get(f"{url}/{conversation.id}/items", params={"order": "up"}).json()["error"]["param"] == "order"
    assert httpx.get(f"{url}/{conversation.id}/items", params={"after": "msg_2"}).json()["error"]["param"] == "after"
    assert httpx.get(f"{url}/{conversation.id}/items", params={"include": "everything"}).status_code == 400
    assert (
        httpx.get(f"{url}/{conversation.id}/items", params={"include": "reasoning.encrypted_content"}).status_code
        == 200
    )
    with pytest.raises(openai.NotFoundError):
        client.conversations.update("conv_missing", metadata={})
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, conversation="conv_missing", input="Hi")
    assert info.value.body["param"] == "conversation"
    first = client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, conversation=conversation.id, previous_response_id=first.id, input="x")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:  # an item the conversation holds, given again
        client.responses.create(
            model=MODEL, conversation=conversation.id, input=[{"id": "msg_1", "role": "user", "content": "x"}]
        )
    assert info.value.body["param"] == "input[0].id"


def test_responses_continue_a_conversation(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    conversation = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    engine.say(ANSWER)
    first = client.responses.create(model=MODEL, conversation=conversation.id, input="What is my name?")
    assert first.conversation.id == conversation.id and first.output_text == "You are Ada."
    assert "My name is Ada." in prompt_text(engine.calls[-1])
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [item.type for item in items] == ["message", "message", "reasoning", "message"]
    assert [item.id for item in items[2:]] == [item.id for item in first.output]

    # The next response continues what the model saw: the same tokens `previous_response_id` gives.
    engine.say(ANSWER, ANSWER)
    client.responses.create(model=MODEL, previous_response_id=first.id, input="Sure?", store=False)
    chained = engine.calls[-1].request.prompt_token_ids
    second = client.responses.create(model=MODEL, conversation={"id": conversation.id}, input="Sure?")
    assert engine.calls[-1].request.prompt_token_ids == chained
    assert second.conversation.id == conversation.id

    # Items added or deleted by hand change what the next response reads.
    client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "I live in Paris."}])
    client.conversations.items.delete(items[0].id, conversation_id=conversation.id)
    client.responses.create(model=MODEL, conversation=conversation.id, input="Where do I live?")
    text = prompt_text(engine.calls[-1])
    assert "I live in Paris." in text and "My name is Ada." not in text and "You are Ada." in text
    # 1 created; 3 of each of the first two responses (its input, reasoning and answer), 1 added,
    # 1 deleted, 2 of the last (its input and answer: "OK.", no reasoning).
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == 1 + 3 + 3 + 1 - 1 + 2


def test_a_conversation_continues_across_a_restart(tmp_path, store_url):
    store = tmp_path / "responses.sqlite3"
    engine = ScriptedEngine().say(ANSWER)
    with LiveServer(make_app(lambda: engine, store, store_url=store_url)) as server:
        client = server.client()
        conversation = client.conversations.create(
            items=[{"role": "user", "content": "My name is Ada."}], metadata={"k": "v"}
        )
        client.responses.create(model=MODEL, conversation=conversation.id, input="What is my name?")
        engine.say(ANSWER)
        client.responses.create(model=MODEL, conversation=conversation.id, input="And again?", store=False)
        expected = engine.calls[-1].request.prompt_token_ids
    engine = ScriptedEngine().say(ANSWER)
    with LiveServer(make_app(lambda: engine, store, store_url=store_url)) as server:
        client = server.client()
        assert client.conversations.retrieve(conversation.id).metadata == {"k": "v"}
        client.responses.create(model=MODEL, conversation=conversation.id, input="And again?")
        start = len(assistant_start_tokens())  # (the prompt before ends where the model was to answer)
        assert engine.calls[-1].request.prompt_token_ids[: len(expected) - start] == expected[:-start]
        text = prompt_text(engine.calls[-1])
        assert text.count("My name is Ada.") == 1 and text.count("What is my name?") == 1
        assert text.count("And again?") == 2  # the answer to the first "And again?" went in too


def test_a_conversation_on_the_real_engine(tiny_engine_server):
    client = tiny_engine_server.client()
    conversation = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    first = client.responses.create(model=MODEL, conversation=conversation.id, input="Name?", max_output_tokens=6)
    assert first.status in ("completed", "incomplete") and first.conversation.id == conversation.id
    counted = client.responses.input_tokens.count(model=MODEL, conversation=conversation.id, input="Again?")
    second = client.responses.create(model=MODEL, conversation=conversation.id, input="Again?", max_output_tokens=6)
    assert second.usage.input_tokens == counted.input_tokens > first.usage.input_tokens
    listed = client.conversations.items.list(conversation.id, order="asc", limit=100).data
    assert [item.id for item in listed][-len(second.output) :] == [item.id for item in second.output]
