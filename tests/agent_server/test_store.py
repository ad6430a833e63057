"""The store's interfaces (`ResponseStore`, `ConversationStore`), the same tests on each backend:
SQLite (the default) and PostgreSQL (a throwaway server, tests/postgres.py). Then what only a
shared store does: several servers' stores on one database, a run's owner asked to stop it by
another server, and a run whose owner died marked failed by another."""

from __future__ import annotations

import asyncio

import pytest

from agent_server.store import SQLiteResponseStore, StoredConversation, StoredResponse, settled


@pytest.fixture
async def open_store(store_url, tmp_path):
    """Opens a store of the backend (each call another store on the same file or database, as
    another server would); all closed at the end."""
    opened = []
    url = store_url

    async def open_(**options):
        if url is None:
            store = SQLiteResponseStore(tmp_path / "responses.sqlite3")
        else:
            from agent_server.store_postgres import PostgresStore

            store = await PostgresStore.open(url, **options)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.close()


@pytest.fixture
async def store(open_store):
    return await open_store()


def response(rid: str, status: str = "completed", *, output=(), owner=None, events=None, created_at=None):
    record = StoredResponse(
        id=rid,
        response={"id": rid, "status": status, "output": list(output)},
        input_items=[{"id": f"in_{rid}", "type": "message", "role": "user", "content": "hi"}],
        conversation=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        function_calls={"call_1": "f"},
        events=events,
        owner=owner,
    )
    if created_at is not None:
        record.created_at = created_at
    return record


def event(seq: int, kind: str = "response.output_text.delta") -> dict:
    return {"type": kind, "sequence_number": seq, "delta": f"d{seq}"}


# --- responses ------------------------------------------------------------------------------


async def test_a_response_is_stored_read_and_replaced(store):
    assert await store.get("resp_none") is None
    await store.put(response("resp_1", "in_progress", output=[{"id": "msg_1", "type": "message"}]))
    got = await store.get("resp_1")
    assert got.status == "in_progress" and got.events is None
    assert got.input_items[0]["id"] == "in_resp_1" and got.function_calls == {"call_1": "f"}
    assert got.conversation == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    await store.put(response("resp_1", "completed", output=[{"id": "msg_2", "type": "message"}]))
    assert (await store.get("resp_1")).status == "completed"
    # The item index follows the record: its old output item is gone, its new one found.
    assert await store.find_item("msg_1") is None
    assert (await store.find_item("msg_2"))["id"] == "msg_2"
    assert (await store.find_item("in_resp_1"))["content"] == "hi"


async def test_a_background_response_keeps_its_events(store):
    await store.put(response("resp_bg", "in_progress", events=[event(0, "response.created"), event(1)]))
    await store.append_events("resp_bg", [event(2), event(3)])
    await store.append_events("resp_bg", [event(3), event(4)])  # (one already stored: kept once)
    got = await store.get("resp_bg")
    assert [e["sequence_number"] for e in got.events] == [0, 1, 2, 3, 4]
    assert got.events[2] == event(2)
    assert (await store.get("resp_bg", events=False)).events == []  # (it has some, not read)
    assert [e["sequence_number"] for e in await store.events_after("resp_bg", 2)] == [3, 4]
    assert await store.events_after("resp_bg", 4) == []
    # The final record brings every event again: those stored stay as they are.
    final = response("resp_bg", "completed", events=[event(i) for i in range(6)])
    await store.put(final)
    assert [e["sequence_number"] for e in (await store.get("resp_bg")).events] == list(range(6))


async def test_deleting_a_response_deletes_its_events_and_items(store):
    await store.put(response("resp_d", events=[event(0)], output=[{"id": "msg_d", "type": "message"}]))
    assert await store.delete("resp_d") is True
    assert await store.get("resp_d") is None
    assert await store.events_after("resp_d", -1) == []
    assert await store.find_item("msg_d") is None
    assert await store.delete("resp_d") is False


async def test_an_item_is_found_in_the_newest_response_its_requester_may_see(store):
    item = {"id": "msg_shared", "type": "message", "role": "assistant", "content": "old"}
    await store.put(response("resp_old", output=[item], owner="alice", created_at=1.0))
    await store.put(response("resp_new", output=[{**item, "content": "new"}], owner="bob", created_at=2.0))
    assert (await store.find_item("msg_shared", "alice"))["content"] == "old"
    assert (await store.find_item("msg_shared", "bob"))["content"] == "new"
    assert await store.find_item("msg_shared", "carol") is None
    assert (await store.find_item("msg_shared"))["content"] == "new"  # (no keys: every response)


async def test_settled_waits_for_a_response_to_end(store):
    await store.put(response("resp_s", "in_progress"))
    assert (await settled(store, "resp_s", 0.1)).status == "in_progress"  # (still running: as it is)

    async def finish():
        await asyncio.sleep(0.3)
        await store.put(response("resp_s", "completed"))

    finishing = asyncio.create_task(finish())
    assert (await settled(store, "resp_s", 10)).status == "completed"
    await finishing
    assert await settled(store, "resp_missing", 10) is None


# --- conversations --------------------------------------------------------------------------


def item(n: int) -> dict:
    return {"id": f"msg_{n}", "type": "message", "role": "user", "content": f"item {n}"}


async def test_a_conversation_and_its_items(store):
    conversation = StoredConversation(id="conv_1", metadata={"topic": "a"}, created_at=5.0, owner="alice")
    await store.create_conversation(conversation, [item(0), item(1)])
    got = await store.get_conversation("conv_1")
    assert (got.metadata, got.version, got.created_at, got.state) == ({"topic": "a"}, 0, 5.0, None)
    assert got.owner == "alice"  # (what the conversations routes check against the requester)
    updated = await store.update_conversation("conv_1", {"topic": "b"})
    assert (updated.metadata, updated.owner) == ({"topic": "b"}, "alice")
    assert await store.update_conversation("conv_none", {}) is None

    added = await store.add_conversation_items("conv_1", [item(2), item(3)])
    assert (added.version, added.owner) == (1, "alice")
    ids = lambda items: [i["id"] for i in items]  # noqa: E731
    assert ids(await store.conversation_items("conv_1")) == ["msg_0", "msg_1", "msg_2", "msg_3"]
    assert ids(await store.conversation_items("conv_1", descending=True, limit=2)) == ["msg_3", "msg_2"]
    assert ids(await store.conversation_items("conv_1", after="msg_1")) == ["msg_2", "msg_3"]
    assert ids(await store.conversation_items("conv_1", after="msg_2", descending=True)) == ["msg_1", "msg_0"]
    assert ids(await store.conversation_items("conv_1", after="msg_0", limit=1)) == ["msg_1"]
    with pytest.raises(KeyError):
        await store.conversation_items("conv_1", after="msg_none")
    assert await store.conversation_items("conv_none") is None
    assert (await store.conversation_item("conv_1", "msg_2"))["content"] == "item 2"
    assert await store.conversation_item("conv_1", "msg_none") is None

    with pytest.raises(ValueError):  # an id it holds
        await store.add_conversation_items("conv_1", [item(1)])
    with pytest.raises(ValueError):  # an id given twice
        await store.add_conversation_items("conv_1", [item(7), item(7)])
    assert ids(await store.conversation_items("conv_1")) == ["msg_0", "msg_1", "msg_2", "msg_3"]

    deleted = await store.delete_conversation_item("conv_1", "msg_1")
    assert (deleted.version, deleted.owner) == (2, "alice")
    assert await store.delete_conversation_item("conv_1", "msg_1") is None
    await store.add_conversation_items("conv_1", [item(4)])  # (after the gap: still last)
    assert ids(await store.conversation_items("conv_1")) == ["msg_0", "msg_2", "msg_3", "msg_4"]

    assert await store.delete_conversation("conv_1") is True
    assert await store.get_conversation("conv_1") is None
    assert await store.delete_conversation("conv_1") is False
    assert await store.add_conversation_items("conv_1", [item(9)]) is None


async def test_a_conversation_keeps_the_state_of_its_last_response_while_it_matches(store):
    await store.create_conversation(StoredConversation(id="conv_s"), [])
    state = {"conversation": [{"role": "user"}], "function_calls": {}, "input_instructions": [], "mcp_listed": []}
    added = await store.add_conversation_items("conv_s", [item(0)], state, from_version=0)
    assert added.current_state == {**state, "version": 1}
    assert (await store.get_conversation("conv_s")).current_state == {**state, "version": 1}
    # A response that began before another change: its state is not taken.
    await store.add_conversation_items("conv_s", [item(1)])
    stale = await store.add_conversation_items("conv_s", [item(2)], state, from_version=1)
    assert stale.version == 3 and stale.current_state is None
    # An item deleted: the state no longer matches.
    fresh = await store.add_conversation_items("conv_s", [item(3)], state, from_version=3)
    assert fresh.current_state is not None
    assert (await store.delete_conversation_item("conv_s", "msg_0")).current_state is None


async def test_concurrent_additions_to_a_conversation_all_land_in_order(store):
    await store.create_conversation(StoredConversation(id="conv_c"), [])
    await asyncio.gather(*(store.add_conversation_items("conv_c", [item(n)]) for n in range(20)))
    stored = await store.conversation_items("conv_c")
    assert sorted(i["id"] for i in stored) == sorted(f"msg_{n}" for n in range(20))
    assert (await store.get_conversation("conv_c")).version == 20


# --- across servers -------------------------------------------------------------------------


async def test_a_sqlite_store_has_no_other_server_to_ask(tmp_path):
    store = SQLiteResponseStore(tmp_path / "r.sqlite3")
    await store.put(response("resp_r", "in_progress", events=[]))
    assert await store.request_cancel("resp_r") is False
    await store.close()


@pytest.fixture
async def shared(postgres_url):
    """Opens PostgreSQL stores on one database, as servers sharing it do (short leases)."""
    from agent_server.store_postgres import PostgresStore

    opened = []

    async def open_(**options):
        store = await PostgresStore.open(postgres_url, **({"heartbeat": 0.2, "lease": 2.0} | options))
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.close()


async def test_another_server_asks_the_owner_to_cancel_or_delete_a_run(shared):
    owner, other = await shared(), await shared()
    asked = []
    owner.set_cancel_handler(lambda rid, deleted: asked.append((rid, deleted)))
    other.set_cancel_handler(lambda rid, deleted: pytest.fail("the other server owns no run"))
    await owner.put(response("resp_c", "in_progress", events=[event(0)]))
    assert await other.request_cancel("resp_c") is True
    for _ in range(100):
        if asked:
            break
        await asyncio.sleep(0.02)
    assert asked == [("resp_c", False)]  # (notified at once, not at the owner's next heartbeat)
    await owner.put(response("resp_c", "cancelled", events=[event(0), event(1, "response.cancelled")]))
    assert await other.request_cancel("resp_c") is False  # (it ended)

    await owner.put(response("resp_x", "in_progress", events=[]))
    asked.clear()
    assert await other.delete("resp_x") is True
    for _ in range(100):
        if asked:
            break
        await asyncio.sleep(0.02)
    assert asked == [("resp_x", True)]
    # What the owner writes of it afterwards (a write in flight) does not bring it back.
    await owner.append_events("resp_x", [event(1)])
    await owner.put(response("resp_x", "in_progress", events=[]))
    await owner.put(response("resp_x", "cancelled", events=[]))
    assert await other.get("resp_x") is None and await owner.get("resp_x") is None
    await asyncio.gather(owner.close(), other.close())


async def test_a_cancel_request_reaches_the_owner_without_its_notification(shared):
    owner, other = await shared(), await shared()
    asked = []
    owner.set_cancel_handler(lambda rid, deleted: asked.append((rid, deleted)))
    await owner._listener.close()  # (lost: as a dropped connection loses it)
    await owner.put(response("resp_p", "in_progress"))
    assert await other.request_cancel("resp_p") is True
    for _ in range(200):  # the owner's heartbeat polls the flags (and listens again)
        if asked:
            break
        await asyncio.sleep(0.02)
    assert ("resp_p", False) in asked
    await asyncio.gather(owner.close(), other.close())


async def record_once_failed(store, response_id: str):
    """The stored record, polled until a heartbeat has marked it failed (or about 10 s passed)."""
    for _ in range(200):
        record = await store.get(response_id)
        if record.status == "failed":
            break
        await asyncio.sleep(0.05)
    return record


async def test_a_run_whose_owner_died_is_marked_failed_by_another_server(shared):
    owner, other = await shared(), await shared()
    output = [{"id": "msg_1", "type": "message", "status": "in_progress", "content": []}]
    await owner.put(response("resp_dead", "in_progress", output=output, events=[event(0), event(1)]))
    await owner.put(response("resp_done", "completed"))
    assert await other.sweep() == []  # (its owner is alive)
    # The owner dies: no more heartbeats, its lease runs out (its connections stay, as a hung
    # server's would, and it may still try to write).
    owner._beating.cancel()
    record = await record_once_failed(other, "resp_dead")
    assert record.status == "failed" and record.response["error"]["code"] == "server_error"
    assert record.response["output"][0]["status"] == "incomplete"
    assert [e["sequence_number"] for e in record.events] == [0, 1]
    assert (await other.get("resp_done")).status == "completed"
    # The dead owner's late writes are dropped, and its run told to stop.
    stopped = []
    owner.set_cancel_handler(lambda rid, deleted: stopped.append(rid))
    await owner.append_events("resp_dead", [event(2)])
    await owner.put(response("resp_dead", "completed", events=[event(0), event(1), event(2)]))
    assert (await other.get("resp_dead")).status == "failed"
    assert len((await other.get("resp_dead")).events) == 2
    assert stopped == ["resp_dead"]
    await asyncio.gather(owner.close(), other.close())


async def test_changed_wakes_a_follower_when_the_owner_writes(shared):
    owner, follower = await shared(), await shared()
    await owner.put(response("resp_f", "in_progress", events=[]))
    loop = asyncio.get_running_loop()
    started = loop.time()
    waiting = asyncio.create_task(follower.changed("resp_f", 10))
    await asyncio.sleep(0.1)
    await owner.append_events("resp_f", [event(0)])
    await waiting
    assert loop.time() - started < 5
    assert await follower.events_after("resp_f", -1) == [event(0)]
    await asyncio.gather(owner.close(), follower.close())


@pytest.mark.slow  # (a PostgreSQL server)
async def test_a_run_taken_over_by_another_server_is_stopped_not_deleted(shared):
    """The owner lost the database longer than its lease; another server's sweep failed its run.
    When the owner is back, its next write is fenced: its run stops, as a cancel, and the
    record (failed, with what was stored) stays; a deleted record still stops it as deleted."""
    owner, other = await shared(), await shared()
    stopped = []
    owner.set_cancel_handler(lambda rid, deleted: stopped.append((rid, deleted)))
    output = [{"id": "msg_1", "type": "message", "status": "in_progress", "content": []}]
    await owner.put(response("resp_t", "in_progress", output=output, events=[event(0)]))
    owner._beating.cancel()  # (cut off: no more heartbeats)
    await asyncio.gather(owner._beating, return_exceptions=True)
    for _ in range(200):
        if "resp_t" in await other.sweep():
            break
        await asyncio.sleep(0.05)
    assert (await other.get("resp_t")).status == "failed"
    await owner.put(response("resp_t", "in_progress", output=output, events=[event(0), event(1)]))
    assert stopped == [("resp_t", False)]  # (taken over: not deleted)
    await owner.put(response("resp_t", "cancelled", events=[event(0), event(1)]))  # (its final write: dropped)
    kept = await other.get("resp_t")
    assert kept.status == "failed" and [e["sequence_number"] for e in kept.events] == [0]

    await owner._renew_lease()
    await owner.put(response("resp_d", "in_progress", events=[]))
    assert await other.delete("resp_d") is True
    stopped.clear()
    await owner.put(response("resp_d", "in_progress", events=[]))
    assert ("resp_d", True) in stopped and await other.get("resp_d") is None
    await asyncio.gather(owner.close(), other.close())


@pytest.mark.slow  # (a PostgreSQL server)
async def test_a_running_record_its_live_owner_no_longer_runs_is_marked_failed(shared):
    """The owner is alive but the final write of a run failed: its heartbeat marks the record
    failed (with what was stored) once no run of it was seen for the grace; its live runs' stay."""
    owner = await shared()
    live = {"resp_live"}
    owner.set_live_runs(lambda rid: rid in live)
    output = [{"id": "msg_1", "type": "message", "status": "in_progress", "content": []}]
    await owner.put(response("resp_orphan", "in_progress", output=output, events=[event(0)]))
    await owner.put(response("resp_live", "in_progress", events=[]))
    assert (await owner.get("resp_orphan")).status == "in_progress"  # (within the grace)
    record = await record_once_failed(owner, "resp_orphan")
    assert record.status == "failed" and record.response["error"]["code"] == "server_error"
    assert record.response["output"][0]["status"] == "incomplete" and [e["sequence_number"] for e in record.events] == [
        0
    ]
    assert (await owner.get("resp_live")).status == "in_progress"
    await owner.close()
