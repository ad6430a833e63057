"""Several API keys, and whose responses each may see.

Keys come from `--api-key` (owner `default`) and `--api-keys-file` (`name:key` lines; keys of
one name share their responses). A response belongs to the owner of the key that created it:
another owner gets the same 404 as for a missing id, whatever they try (retrieve, delete,
cancel, input items, stream resume, previous_response_id, item_reference, compact, input_tokens,
over HTTP or a WebSocket), while the response runs and after it is stored, and after a restart.
Conversations are owned the same way: every conversations route, and `conversation` on a create.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai
import pytest
from websockets.sync.client import connect

from agent_server.auth import anonymous_owner, read_keys_file
from tests.conftest import MODEL, LiveServer, make_app, serve_captured
from tests.fake_engine import ScriptedEngine

KEYS = {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}
DEFAULT_KEY = "sk-default"


def client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@contextlib.contextmanager
def keyed_server(tmp_path, store_url: str | None = None):
    """A server with the keys, on SQLite or (`store_url`) PostgreSQL; `.alice`, `.alice2`, `.bob`,
    `.default`: a client with each key."""
    engine = ScriptedEngine(token_delay=0.01)
    app = make_app(lambda: engine, tmp_path / "r.db", api_key=DEFAULT_KEY, api_keys=KEYS, store_url=store_url)
    with LiveServer(app, api_key=DEFAULT_KEY) as live:
        live.alice, live.alice2, live.bob, live.default = (
            client(live, k) for k in ("sk-alice-1", "sk-alice-2", "sk-bob", DEFAULT_KEY)
        )
        live.engine_ = engine
        yield live


@pytest.fixture
def server(tmp_path):
    with keyed_server(tmp_path) as live:
        yield live


@pytest.fixture
def server_on_each_store(tmp_path, store_url):
    """`server` on each store backend (PostgreSQL's with the slow tests)."""
    with keyed_server(tmp_path, store_url) as live:
        yield live


def long_answer(engine, words: int = 400) -> None:
    engine.say("<|channel|>final<|message|>" + "go " * words + "<|return|>")


def assert_missing(r: httpx.Response, response_id: str, param: str | None = None) -> None:
    """Exactly the 404 of an id that does not exist."""
    assert r.status_code == 404, (r.status_code, r.text[:300])
    error = r.json()["error"]
    # (OpenAI's code for a previous_response_id it cannot find is previous_response_not_found)
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    assert error["code"] == code and error["param"] == param and response_id in error["message"]


def test_another_owner_cannot_reach_a_stored_response(server):
    created = server.alice.post("/v1/responses", json={"model": MODEL, "input": "my secret"}).json()
    rid = created["id"]
    item_id = created["output"][0]["id"]
    missing = server.bob.get("/v1/responses/resp_doesnotexist")
    bob_view = server.bob.get(f"/v1/responses/{rid}")
    assert_missing(bob_view, rid)
    assert bob_view.json()["error"]["message"] == missing.json()["error"]["message"].replace("resp_doesnotexist", rid)
    assert_missing(server.bob.get(f"/v1/responses/{rid}/input_items"), rid)
    assert_missing(server.bob.post(f"/v1/responses/{rid}/cancel"), rid)
    assert_missing(server.bob.get(f"/v1/responses/{rid}", params={"stream": "true"}), rid)
    assert_missing(
        server.bob.post("/v1/responses", json={"model": MODEL, "input": "go on", "previous_response_id": rid}),
        rid,
        "previous_response_id",
    )
    r = server.bob.post("/v1/responses", json={"model": MODEL, "input": [{"type": "item_reference", "id": item_id}]})
    assert_missing(r, item_id, "input[0].id")
    assert_missing(server.bob.delete(f"/v1/responses/{rid}"), rid)
    assert_missing(server.default.get(f"/v1/responses/{rid}"), rid)  # --api-key's owner is another one
    # Alice, with either of her keys, still has all of it.
    for alice in (server.alice, server.alice2):
        assert alice.get(f"/v1/responses/{rid}").json()["output"][0]["content"][0]["text"] == "OK."
        assert alice.get(f"/v1/responses/{rid}/input_items").json()["data"][0]["content"][0]["text"] == "my secret"
    r = server.alice2.post("/v1/responses", json={"model": MODEL, "input": "go on", "previous_response_id": rid})
    assert r.status_code == 200 and r.json()["previous_response_id"] == rid
    r = server.alice2.post("/v1/responses", json={"model": MODEL, "input": [{"type": "item_reference", "id": item_id}]})
    assert r.status_code == 200
    assert server.alice.delete(f"/v1/responses/{rid}").json()["deleted"] is True
    assert_missing(server.alice.get(f"/v1/responses/{rid}"), rid)


def test_another_owner_cannot_reach_a_running_response(server):
    long_answer(server.engine_, 2000)  # 20 s at 10 ms a token: still running throughout
    rid = server.alice.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True}).json()["id"]
    deadline = time.monotonic() + 20
    while server.alice.get(f"/v1/responses/{rid}").json()["status"] != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert_missing(server.bob.get(f"/v1/responses/{rid}"), rid)
    assert_missing(server.bob.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "0"}), rid)
    assert_missing(server.bob.get(f"/v1/responses/{rid}/input_items"), rid)
    assert_missing(server.bob.post(f"/v1/responses/{rid}/cancel"), rid)
    assert_missing(server.bob.delete(f"/v1/responses/{rid}"), rid)
    assert_missing(
        server.bob.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": rid}),
        rid,
        "previous_response_id",
    )
    # Untouched by all that: still running for Alice, whose stream resumes, and who can cancel it.
    assert server.alice.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
    with server.alice.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                assert json.loads(line[5:])["sequence_number"] == 0
                break
    assert server.alice.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"


def test_ownership_outlives_a_restart(tmp_path):
    store = tmp_path / "r.db"
    with LiveServer(make_app(ScriptedEngine, store, api_keys=KEYS), api_key="sk-bob") as live:
        rid = client(live, "sk-alice-1").post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()["id"]
    with LiveServer(make_app(ScriptedEngine, store, api_keys=KEYS), api_key="sk-bob") as live:
        assert_missing(client(live, "sk-bob").get(f"/v1/responses/{rid}"), rid)
        assert client(live, "sk-alice-2").get(f"/v1/responses/{rid}").status_code == 200
    # A server with no key has one user, who sees everything in the store.
    with LiveServer(make_app(ScriptedEngine, store)) as live:
        assert httpx.get(f"{live.url}/v1/responses/{rid}").status_code == 200


def test_another_owner_cannot_reach_a_response_through_compact_count_or_a_websocket(server):
    rid = server.alice.post("/v1/responses", json={"model": MODEL, "input": "my secret"}).json()["id"]
    for path in ("/v1/responses/compact", "/v1/responses/input_tokens"):
        r = server.bob.post(path, json={"model": MODEL, "input": "go on", "previous_response_id": rid})
        assert_missing(r, rid, "previous_response_id")
        assert server.alice.post(path, json={"model": MODEL, "previous_response_id": rid}).status_code == 200
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    go_on = {"type": "response.create", "model": MODEL, "input": "go on", "previous_response_id": rid}
    with connect(url, additional_headers={"Authorization": "Bearer sk-bob"}) as socket:
        socket.send(json.dumps(go_on))
        error = json.loads(socket.recv(timeout=30))
        assert error["status"] == 404 and error["error"]["code"] == "previous_response_not_found"
    with connect(url, additional_headers={"Authorization": "Bearer sk-alice-2"}) as socket:
        socket.send(json.dumps(go_on))
        while (event := json.loads(socket.recv(timeout=30)))["type"] != "response.completed":
            assert event["type"] != "error", event
    # What a WebSocket made (stored) is its key's owner's.
    made = event["response"]["id"]
    assert server.alice.get(f"/v1/responses/{made}").status_code == 200
    assert_missing(server.bob.get(f"/v1/responses/{made}"), made)


def test_another_owner_cannot_reach_a_conversation(server_on_each_store):
    server = server_on_each_store
    made = server.alice.post(
        "/v1/conversations", json={"metadata": {"topic": "secret"}, "items": [{"role": "user", "content": "my secret"}]}
    )
    conv = made.json()["id"]
    item = server.alice.get(f"/v1/conversations/{conv}/items").json()["data"][0]["id"]

    def missing(r: httpx.Response, ident: str = conv, param: str = "conversation_id") -> None:
        assert r.status_code == 404, (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["code"] == "not_found" and error["param"] == param and ident in error["message"]
        assert error["message"] == f"Conversation with id '{ident}' not found."

    nowhere = server.bob.get("/v1/conversations/conv_doesnotexist")
    missing(nowhere, "conv_doesnotexist")
    missing(server.bob.get(f"/v1/conversations/{conv}"))
    missing(server.bob.post(f"/v1/conversations/{conv}", json={"metadata": {"topic": "mine now"}}))
    missing(server.bob.get(f"/v1/conversations/{conv}/items"))
    missing(server.bob.post(f"/v1/conversations/{conv}/items", json={"items": [{"role": "user", "content": "x"}]}))
    missing(server.bob.get(f"/v1/conversations/{conv}/items/{item}"))
    missing(server.bob.delete(f"/v1/conversations/{conv}/items/{item}"))
    missing(server.bob.delete(f"/v1/conversations/{conv}"))
    missing(server.default.get(f"/v1/conversations/{conv}"))  # --api-key's owner is another one
    r = server.bob.post("/v1/responses", json={"model": MODEL, "input": "go on", "conversation": conv})
    missing(r, param="conversation")
    r = server.bob.post("/v1/responses", json={"model": MODEL, "input": "go on", "conversation": {"id": conv}})
    missing(r, param="conversation")
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    with connect(url, additional_headers={"Authorization": "Bearer sk-bob"}) as socket:
        socket.send(json.dumps({"type": "response.create", "model": MODEL, "input": "x", "conversation": conv}))
        error = json.loads(socket.recv(timeout=30))
        assert error["status"] == 404 and error["error"]["param"] == "conversation"
    # Bob's own conversation cannot take Alice's items by reference either.
    bobs = server.bob.post("/v1/conversations", json={}).json()["id"]
    r = server.bob.post(f"/v1/conversations/{bobs}/items", json={"items": [{"type": "item_reference", "id": item}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

    # Untouched by all that, and all Alice's, with either of her keys.
    for alice in (server.alice, server.alice2):
        assert alice.get(f"/v1/conversations/{conv}").json()["metadata"] == {"topic": "secret"}
        assert [i["id"] for i in alice.get(f"/v1/conversations/{conv}/items").json()["data"]] == [item]
    r = server.alice2.post("/v1/responses", json={"model": MODEL, "input": "go on", "conversation": conv})
    assert r.status_code == 200 and r.json()["conversation"] == {"id": conv}
    assert len(server.alice.get(f"/v1/conversations/{conv}/items").json()["data"]) == 3
    assert server.alice.post(f"/v1/conversations/{conv}", json={"metadata": {"topic": "x"}}).status_code == 200
    assert server.alice.delete(f"/v1/conversations/{conv}").json()["deleted"] is True
    missing(server.alice.get(f"/v1/conversations/{conv}"))


def test_conversation_ownership_outlives_a_restart(tmp_path):
    store = tmp_path / "r.db"
    with LiveServer(make_app(ScriptedEngine, store, api_keys=KEYS), api_key="sk-bob") as live:
        conv = client(live, "sk-alice-1").post("/v1/conversations", json={}).json()["id"]
    with LiveServer(make_app(ScriptedEngine, store, api_keys=KEYS), api_key="sk-bob") as live:
        assert client(live, "sk-bob").get(f"/v1/conversations/{conv}").status_code == 404
        assert client(live, "sk-alice-2").get(f"/v1/conversations/{conv}").status_code == 200
    with LiveServer(make_app(ScriptedEngine, store)) as live:  # no key: one user, who sees it
        assert httpx.get(f"{live.url}/v1/conversations/{conv}").status_code == 200


def test_a_store_from_before_conversation_owners_opens(tmp_path):
    """Conversations stored before they had owners get the column, and no owner: on a server with
    keys no key sees them, on one without, its one user does."""
    import asyncio
    import sqlite3

    from agent_server.store import SQLiteResponseStore, StoredConversation

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE conversations (id TEXT PRIMARY KEY, created_at REAL, metadata TEXT NOT NULL, "
            "version INTEGER NOT NULL, state TEXT)"
        )
        db.execute("INSERT INTO conversations VALUES ('conv_old', 1.0, '{}', 0, NULL)")
    store = SQLiteResponseStore(path)
    try:
        assert asyncio.run(store.get_conversation("conv_old")).owner is None
        asyncio.run(store.create_conversation(StoredConversation(id="conv_new", owner="alice"), []))
        assert asyncio.run(store.get_conversation("conv_new")).owner == "alice"
    finally:
        asyncio.run(store.close())


@pytest.mark.slow  # (a PostgreSQL server)
def test_a_postgresql_store_from_before_conversation_owners_opens(postgres_url):
    """The same on PostgreSQL: the column is added to a database that lacks it."""
    import asyncio

    import asyncpg

    from agent_server.store import StoredConversation
    from agent_server.store_postgres import PostgresStore

    async def check():
        conn = await asyncpg.connect(postgres_url)
        await conn.execute(
            "CREATE TABLE conversations (id TEXT PRIMARY KEY, created_at DOUBLE PRECISION, "
            "metadata TEXT NOT NULL, version INTEGER NOT NULL, state TEXT)"
        )
        await conn.execute("INSERT INTO conversations VALUES ('conv_old', 1.0, '{}', 0, NULL)")
        await conn.close()
        store = await PostgresStore.open(postgres_url)
        try:
            assert (await store.get_conversation("conv_old")).owner is None
            await store.create_conversation(StoredConversation(id="conv_new", owner="alice"), [])
            assert (await store.get_conversation("conv_new")).owner == "alice"
        finally:
            await store.close()

    asyncio.run(check())


def test_the_sdk_with_several_keys(server):
    alice, bob = (
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=k, max_retries=0) for k in ("sk-alice-1", "sk-bob")
    )
    response = alice.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(response.id)
    assert alice.responses.retrieve(response.id).id == response.id
    conversation = alice.conversations.create(items=[{"role": "user", "content": "hi"}])
    for call in (
        lambda: bob.conversations.retrieve(conversation.id),
        lambda: bob.conversations.items.list(conversation.id),
        lambda: bob.conversations.delete(conversation.id),
        lambda: bob.responses.create(model=MODEL, input="x", conversation=conversation.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.create(model=MODEL, input="x", conversation=conversation.id).conversation.id == (
        conversation.id
    )


def test_unknown_keys_are_refused(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sk-carol"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# --- the keys file --------------------------------------------------------------------------


def test_reading_a_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(
        "# team keys\nalice:sk-a1\n\n  alice:sk-a2  \nbob@example.com:sk-b\nsk-anonymous\ncarol:sk-c:with-colon\n"
    )
    assert read_keys_file(path) == {
        "sk-a1": "alice",
        "sk-a2": "alice",
        "sk-b": "bob@example.com",
        "sk-anonymous": anonymous_owner("sk-anonymous"),
        "sk-c:with-colon": "carol",
    }
    assert anonymous_owner("sk-anonymous").startswith("key-") and "sk-anonymous" not in anonymous_owner("sk-anonymous")
    for bad, problem in [
        ("alice:\n", "empty"),
        ("bad name:sk-x\n", "name"),
        ("alice:sk x\n", "white space"),
        ("a:sk-1\nb:sk-1\n", "twice"),
        ("# nothing\n\n", "no keys"),
    ]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=problem):
            read_keys_file(path)


def test_serve_reads_the_keys_file(tiny_checkpoint, tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("alice:sk-a\nbob:sk-b\n")
    path.chmod(0o600)
    served = serve_captured(
        [
            "--model",
            str(tiny_checkpoint),
            "--store",
            str(tmp_path / "r.db"),
            "--api-keys-file",
            str(path),
            "--api-key",
            "sk-d",
        ]
    )
    config = served["app"].state.server.config
    assert config.api_keys == {"sk-a": "alice", "sk-b": "bob"} and config.api_key == "sk-d"

    from agent_server.cli.main import build_parser
    from agent_server.cli.serve import run

    path.write_text("bad name:sk\n")
    assert run(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), "--api-keys-file", str(path)])) == 2
    assert (
        run(
            build_parser().parse_args(
                ["serve", "--model", str(tiny_checkpoint), "--api-keys-file", str(tmp_path / "missing")]
            )
        )
        == 2
    )
