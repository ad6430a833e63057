"""The response and conversation store in PostgreSQL, shared by any number of servers
(`oss-agent serve --store postgresql://USER:PASSWORD@HOST/DB`), through asyncpg's pool.

The tables are those of `SQLiteResponseStore` (records and items as JSON text), and the same
interfaces (`ResponseStore`, `ConversationStore`). What sharing adds:

- Ownership. Each server has an id and a lease in `store_servers`, renewed every `heartbeat`
  seconds for `lease` seconds. A response it stores while running carries its id
  (`responses.server_id`), and only that server writes it: its writes are fenced by the id.
- A dead owner. Every server sweeps, each heartbeat, the running responses whose owner's lease
  has run out: they read `failed` with the output written until then (as SQLite's do after a
  restart) and lose their owner, so what the owner might still write (it was only cut off) is
  dropped, and its run is stopped when it notices.
- A record with no run. A running record a server owns but no longer runs (its final write
  failed) is marked failed by that server's heartbeat, after a grace of a few heartbeats.
- Stopping a run from another server. `request_cancel` flags the record and notifies its owner
  (LISTEN/NOTIFY on `oss_agent_stop`); deleting a running response notifies it too. The owner
  also polls the flags each heartbeat, should a notification be lost with a connection.
- Following a run from another server. Each write notifies `oss_agent_changed` with the
  response id; `changed` waits for one (or a timeout), `events_after` reads what was appended.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import asdict
from typing import Any, Callable

import asyncpg

from agent_server.ownership import visible
from agent_server.store import (
    RUNNING,
    CancelHandler,
    StoredConversation,
    StoredResponse,
    interrupted,
    record_item_ids,
    record_items,
)

log = logging.getLogger(__name__)

STOP_CHANNEL = "oss_agent_stop"  # payload: {"server": owner id, "id": response id, "deleted": bool}
CHANGED_CHANNEL = "oss_agent_changed"  # payload: the response id
SCHEMA_LOCK = 0x6F73_735F_6167  # the advisory lock that serialises creating the tables

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS store_servers (id TEXT PRIMARY KEY, "
    "started_at TIMESTAMPTZ NOT NULL DEFAULT now(), expires_at TIMESTAMPTZ NOT NULL)",
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at DOUBLE PRECISION, "
    "status TEXT, record TEXT NOT NULL, server_id TEXT, cancel_requested BOOLEAN NOT NULL DEFAULT false)",
    "CREATE INDEX IF NOT EXISTS responses_running ON responses (server_id) WHERE status IN ('queued', 'in_progress')",
    # Which responses hold each input and output item (`item_reference` finds them).
    "CREATE TABLE IF NOT EXISTS response_items (id TEXT NOT NULL, "
    "response_id TEXT NOT NULL REFERENCES responses (id) ON DELETE CASCADE, PRIMARY KEY (id, response_id))",
    "CREATE INDEX IF NOT EXISTS response_items_by_response ON response_items (response_id)",
    "CREATE TABLE IF NOT EXISTS response_events (response_id TEXT NOT NULL REFERENCES responses (id) "
    "ON DELETE CASCADE, seq BIGINT NOT NULL, event TEXT NOT NULL, PRIMARY KEY (response_id, seq))",
    "CREATE TABLE IF NOT EXISTS conversations (id TEXT PRIMARY KEY, created_at DOUBLE PRECISION, "
    "metadata TEXT NOT NULL, version INTEGER NOT NULL, state TEXT, owner TEXT)",
    # (a database written before conversations had owners gets the column; theirs stay NULL)
    "ALTER TABLE conversations ADD COLUMN IF NOT EXISTS owner TEXT",
    # An item's place in its conversation: `position` orders them (gaps where items were deleted).
    "CREATE TABLE IF NOT EXISTS conversation_items (conversation_id TEXT NOT NULL REFERENCES conversations (id) "
    "ON DELETE CASCADE, position INTEGER NOT NULL, id TEXT NOT NULL, item TEXT NOT NULL, "
    "PRIMARY KEY (conversation_id, position), UNIQUE (conversation_id, id))",
]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class PostgresStore:
    """`ResponseStore` and `ConversationStore` in a PostgreSQL database several servers share.
    Build it with `await PostgresStore.open(url)`."""

    def __init__(
        self,
        url: str,
        *,
        heartbeat: float = 3.0,
        lease: float = 15.0,
        pool_size: int = 10,
        orphan_grace: float | None = None,
    ):
        if lease <= heartbeat:
            raise ValueError("the lease must outlast several heartbeats")
        self.url = url
        self.heartbeat = heartbeat
        self.lease = lease
        # How long a running record of ours may have no run before it is marked failed.
        self.orphan_grace = 3 * heartbeat if orphan_grace is None else orphan_grace
        self.pool_size = pool_size
        self.server_id = f"srv_{uuid.uuid4().hex}"
        self._pool: asyncpg.Pool | None = None
        self._listener: asyncpg.Connection | None = None
        self._beating: asyncio.Task | None = None
        self._on_cancel: CancelHandler | None = None
        self._live: Callable[[str], bool] | None = None  # whether this server still runs a response
        self._orphans: dict[str, float] = {}  # running records of ours with no run -> when first seen so
        self._running: set[str] = set()  # ids this server stored unfinished: written by update only
        self._lost: set[str] = set()  # ids it ran that were deleted or failed meanwhile: never written again
        self._changes: dict[str, tuple[asyncio.Event, int]] = {}  # response id -> (event, waiters)
        self._closed = False

    @classmethod
    async def open(cls, url: str, **options: Any) -> PostgresStore:
        store = cls(url, **options)
        await store._start()
        return store

    async def _start(self) -> None:
        self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=self.pool_size)
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
                for statement in SCHEMA:
                    await conn.execute(statement)
            await self._renew_lease()
            await self._listen()
        except BaseException:
            await self._pool.close()
            raise
        self._beating = asyncio.create_task(self._beat())
        log.info("store: PostgreSQL, this server's id %s (lease %.0fs)", self.server_id, self.lease)

    # -- ownership, leases, notifications ---------------------------------------------------

    async def _renew_lease(self) -> None:
        await self._pool.execute(
            "INSERT INTO store_servers (id, expires_at) VALUES ($1, now() + make_interval(secs => $2)) "
            "ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at",
            self.server_id,
            self.lease,
        )

    async def _listen(self) -> None:
        self._listener = await asyncpg.connect(self.url)
        await self._listener.add_listener(STOP_CHANNEL, self._stop_notified)
        await self._listener.add_listener(CHANGED_CHANNEL, self._change_notified)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                await self._renew_lease()
                if self._listener is None or self._listener.is_closed():
                    await self._listen()
                await self._poll_cancels()
                await self.sweep()
                await self.fail_orphans()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the database is away: try again next beat
                log.warning("store heartbeat: %s: %s", type(e).__name__, e)

    async def sweep(self) -> list[str]:
        """Mark failed the running responses whose owner's lease ran out (it died, or lost the
        database): never lost, and no longer written by it. Returns their ids."""
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT id, record FROM responses r WHERE status IN ('queued', 'in_progress') AND NOT EXISTS "
                "(SELECT 1 FROM store_servers s WHERE s.id = r.server_id AND s.expires_at > now()) "
                "FOR UPDATE SKIP LOCKED LIMIT 100"
            )
            for row in rows:
                record = interrupted(StoredResponse(**json.loads(row["record"])))
                fields = asdict(record) | {"events": None if record.events is None else []}
                await conn.execute(
                    "UPDATE responses SET record = $2, status = $3, server_id = NULL WHERE id = $1",
                    record.id,
                    _json(fields),
                    record.status,
                )
                await conn.execute("SELECT pg_notify($1, $2)", CHANGED_CHANNEL, record.id)
            await conn.execute("DELETE FROM store_servers WHERE expires_at < now()")
        ids = [row["id"] for row in rows]
        if ids:
            log.warning("store: %d responses whose server stopped marked failed: %s", len(ids), ", ".join(ids))
        return ids

    async def fail_orphans(self) -> list[str]:
        """Mark failed the running records this server owns but no longer runs, for longer than
        `orphan_grace` (its final write failed: it would read in progress for ever), as a sweep
        does a dead server's. Returns their ids."""
        if self._live is None:
            return []
        rows = await self._pool.fetch(
            "SELECT id FROM responses WHERE server_id = $1 AND status IN ('queued', 'in_progress')", self.server_id
        )
        now = asyncio.get_running_loop().time()
        orphans = {row["id"] for row in rows if not self._live(row["id"])}
        self._orphans = {rid: self._orphans.get(rid, now) for rid in orphans}
        due = [rid for rid, since in self._orphans.items() if now - since >= self.orphan_grace]
        failed = []
        for rid in due:
            async with self._pool.acquire() as conn, conn.transaction():
                raw = await conn.fetchval(
                    "SELECT record FROM responses WHERE id = $1 AND server_id = $2 "
                    "AND status IN ('queued', 'in_progress') FOR UPDATE",
                    rid,
                    self.server_id,
                )
                if raw is None or self._live(rid):  # (ended meanwhile, or a run of it started)
                    continue
                record = interrupted(StoredResponse(**json.loads(raw)))
                fields = asdict(record) | {"events": None if record.events is None else []}
                await conn.execute(
                    "UPDATE responses SET record = $2, status = $3, server_id = NULL WHERE id = $1",
                    rid,
                    _json(fields),
                    record.status,
                )
                await conn.execute("SELECT pg_notify($1, $2)", CHANGED_CHANNEL, rid)
            self._orphans.pop(rid, None)
            self._running.discard(rid)
            self._lost.add(rid)
            failed.append(rid)
        if failed:
            log.warning(
                "store: %d responses of ours with no run left marked failed: %s", len(failed), ", ".join(failed)
            )
        return failed

    async def _poll_cancels(self) -> None:
        """Cancel requests whose notification did not come (a listener reconnecting)."""
        rows = await self._pool.fetch(
            "SELECT id FROM responses WHERE server_id = $1 AND cancel_requested AND status IN ('queued', 'in_progress')",
            self.server_id,
        )
        for row in rows:
            self._stop(row["id"], deleted=False)

    def set_cancel_handler(self, handler: CancelHandler) -> None:
        self._on_cancel = handler

    def set_live_runs(self, live: Callable[[str], bool]) -> None:
        self._live = live

    def _stop(self, response_id: str, deleted: bool) -> None:
        if self._on_cancel is not None:
            self._on_cancel(response_id, deleted)

    def _stop_notified(self, connection, pid, channel, payload: str) -> None:
        message = json.loads(payload)
        if message.get("server") == self.server_id:
            self._stop(message["id"], bool(message.get("deleted")))

    def _change_notified(self, connection, pid, channel, response_id: str) -> None:
        waiting = self._changes.pop(response_id, None)
        if waiting is not None:
            waiting[0].set()

    async def changed(self, response_id: str, timeout: float) -> None:
        event, waiters = self._changes.get(response_id, (asyncio.Event(), 0))
        self._changes[response_id] = (event, waiters + 1)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            current = self._changes.get(response_id)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self._changes[response_id]
                else:
                    self._changes[response_id] = (event, current[1] - 1)

    async def request_cancel(self, response_id: str) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            owner = await conn.fetchval(
                "UPDATE responses SET cancel_requested = true WHERE id = $1 AND status IN ('queued', 'in_progress') "
                "RETURNING server_id",
                response_id,
            )
            if owner is None:  # finished, or its owner died and it was marked failed
                return False
            if owner == self.server_id:
                self._stop(response_id, deleted=False)
            else:
                await conn.execute(
                    "SELECT pg_notify($1, $2)",
                    STOP_CHANNEL,
                    _json({"server": owner, "id": response_id, "deleted": False}),
                )
        return True

    # -- responses ----------------------------------------------------------------------------

    async def put(self, record: StoredResponse) -> None:
        # The events go to their table; the record keeps [] to say it has some there.
        if record.id in self._lost:
            return
        fields = asdict(record) | {"events": None if record.events is None else []}
        args = (record.id, record.created_at, _json(fields), record.status, self.server_id)
        async with self._pool.acquire() as conn, conn.transaction():
            if record.id in self._running:  # (0 rows: deleted, or failed by another server)
                written = await conn.execute(
                    "UPDATE responses SET created_at = $2, record = $3, status = $4 WHERE id = $1 AND server_id = $5",
                    *args,
                )
            else:
                written = await conn.execute(
                    "INSERT INTO responses (id, created_at, record, status, server_id) VALUES ($1, $2, $3, $4, $5) "
                    "ON CONFLICT (id) DO UPDATE SET created_at = EXCLUDED.created_at, record = EXCLUDED.record, "
                    "status = EXCLUDED.status WHERE responses.server_id IS NOT DISTINCT FROM EXCLUDED.server_id",
                    *args,
                )
            fenced = written.endswith(" 0")
            # Fenced: the record was deleted, or it is there but no longer ours (another server's
            # sweep failed it while we were cut off): then it stays as that server left it.
            gone = fenced and await conn.fetchval("SELECT 1 FROM responses WHERE id = $1", record.id) is None
            if not fenced:
                await conn.execute("DELETE FROM response_items WHERE response_id = $1", record.id)
                await conn.execute(
                    "INSERT INTO response_items (id, response_id) SELECT unnest($2::text[]), $1 ON CONFLICT DO NOTHING",
                    record.id,
                    sorted(record_item_ids(record)),
                )
                await self._insert_events(conn, record.id, record.events or [])
                await conn.execute("SELECT pg_notify($1, $2)", CHANGED_CHANNEL, record.id)
        if record.status in RUNNING and not fenced:
            self._running.add(record.id)
        else:
            self._running.discard(record.id)
        if fenced:
            self._lost.add(record.id)
            if gone:
                log.info("response %s was deleted by another server: its run stops", record.id)
            else:
                log.warning(
                    "response %s was marked failed by another server (our lease ran out): its run stops", record.id
                )
            self._stop(record.id, deleted=gone)

    async def _insert_events(self, conn: asyncpg.Connection, response_id: str, events: list[dict[str, Any]]) -> None:
        if events:
            await conn.execute(
                "INSERT INTO response_events (response_id, seq, event) SELECT $1, s, e "
                "FROM unnest($2::bigint[], $3::text[]) AS t (s, e) ON CONFLICT DO NOTHING",
                response_id,
                [e["sequence_number"] for e in events],
                [_json(e) for e in events],
            )

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        async with self._pool.acquire() as conn, conn.transaction():
            owned = await conn.fetchval(  # (locks it: a delete or a sweep waits, or came first)
                "SELECT true FROM responses WHERE id = $1 AND server_id = $2 FOR SHARE", response_id, self.server_id
            )
            if owned:
                await self._insert_events(conn, response_id, events)
                await conn.execute("SELECT pg_notify($1, $2)", CHANGED_CHANNEL, response_id)

    async def get(self, response_id: str, events: bool = True) -> StoredResponse | None:
        raw = await self._pool.fetchval("SELECT record FROM responses WHERE id = $1", response_id)
        if raw is None:
            return None
        record = StoredResponse(**json.loads(raw))
        if events and record.events == []:
            record.events = await self.events_after(response_id, -1)
        return record

    async def events_after(self, response_id: str, after: int) -> list[dict[str, Any]]:
        rows = await self._pool.fetch(
            "SELECT event FROM response_events WHERE response_id = $1 AND seq > $2 ORDER BY seq", response_id, after
        )
        return [json.loads(row["event"]) for row in rows]

    async def find_item(self, item_id: str, requester: str | None = None) -> dict[str, Any] | None:
        rows = await self._pool.fetch(  # the newest response holding it first
            "SELECT r.record FROM response_items i JOIN responses r ON r.id = i.response_id "
            "WHERE i.id = $1 ORDER BY r.created_at DESC",
            item_id,
        )
        for row in rows:
            record = StoredResponse(**json.loads(row["record"]))
            if not visible(record.owner, requester):
                continue
            found = next((item for item in record_items(record) if item.get("id") == item_id), None)
            if found is not None:
                return found
        return None

    async def delete(self, response_id: str) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow("DELETE FROM responses WHERE id = $1 RETURNING server_id, status", response_id)
            if row is not None and row["status"] in RUNNING and row["server_id"] not in (None, self.server_id):
                await conn.execute(  # its owner stops it (and stores nothing more of it)
                    "SELECT pg_notify($1, $2)",
                    STOP_CHANNEL,
                    _json({"server": row["server_id"], "id": response_id, "deleted": True}),
                )
            if row is not None:
                await conn.execute("SELECT pg_notify($1, $2)", CHANGED_CHANNEL, response_id)
        return row is not None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._beating is not None:
            self._beating.cancel()
            await asyncio.gather(self._beating, return_exceptions=True)
        try:  # gone at once: what it left running is failed by the next sweep, not after its lease
            await self._pool.execute("DELETE FROM store_servers WHERE id = $1", self.server_id)
        except Exception as e:
            log.warning("store: could not give up this server's lease: %s", e)
        if self._listener is not None and not self._listener.is_closed():
            await self._listener.close()
        await self._pool.close()

    # -- conversations ------------------------------------------------------------------------

    @staticmethod
    def _conversation(row: asyncpg.Record | None) -> StoredConversation | None:
        if row is None:
            return None
        return StoredConversation.from_row(*(row[c] for c in StoredConversation.COLUMNS))

    @staticmethod
    async def _append_items(conn: asyncpg.Connection, conversation_id: str, items: list[dict[str, Any]]) -> None:
        ids = [item["id"] for item in items]
        if len(set(ids)) != len(ids):
            raise ValueError("the items' ids are not unique")
        if not ids:
            return
        taken = await conn.fetchval(
            "SELECT id FROM conversation_items WHERE conversation_id = $1 AND id = ANY($2::text[]) LIMIT 1",
            conversation_id,
            ids,
        )
        if taken is not None:
            raise ValueError(f"the conversation already holds an item with id '{taken}'")
        last = await conn.fetchval(
            "SELECT MAX(position) FROM conversation_items WHERE conversation_id = $1", conversation_id
        )
        start = 0 if last is None else last + 1
        await conn.execute(
            "INSERT INTO conversation_items (conversation_id, position, id, item) "
            "SELECT $1, p, i, j FROM unnest($2::int[], $3::text[], $4::text[]) AS t (p, i, j)",
            conversation_id,
            list(range(start, start + len(items))),
            ids,
            [_json(item) for item in items],
        )

    async def create_conversation(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO conversations (id, created_at, metadata, version, state, owner) "
                "VALUES ($1, $2, $3, $4, $5, $6)",
                *conversation.row(),
            )
            await self._append_items(conn, conversation.id, items)

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        return self._conversation(
            await self._pool.fetchrow("SELECT * FROM conversations WHERE id = $1", conversation_id)
        )

    async def update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None:
        return self._conversation(
            await self._pool.fetchrow(
                "UPDATE conversations SET metadata = $2 WHERE id = $1 RETURNING *",
                conversation_id,
                json.dumps(metadata),
            )
        )

    async def delete_conversation(self, conversation_id: str) -> bool:
        return await self._pool.execute("DELETE FROM conversations WHERE id = $1", conversation_id) != "DELETE 0"

    async def conversation_items(
        self, conversation_id: str, *, after: str | None = None, limit: int | None = None, descending: bool = False
    ) -> list[dict[str, Any]] | None:
        order, beyond = ("DESC", "<") if descending else ("ASC", ">")
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            if await conn.fetchval("SELECT 1 FROM conversations WHERE id = $1", conversation_id) is None:
                return None
            query, args = "SELECT item FROM conversation_items WHERE conversation_id = $1", [conversation_id]
            if after is not None:
                position = await conn.fetchval(
                    "SELECT position FROM conversation_items WHERE conversation_id = $1 AND id = $2",
                    conversation_id,
                    after,
                )
                if position is None:
                    raise KeyError(after)
                args.append(position)
                query += f" AND position {beyond} ${len(args)}"
            query += f" ORDER BY position {order}"
            if limit is not None:
                args.append(limit)
                query += f" LIMIT ${len(args)}"
            return [json.loads(row["item"]) for row in await conn.fetch(query, *args)]

    async def conversation_item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        raw = await self._pool.fetchval(
            "SELECT item FROM conversation_items WHERE conversation_id = $1 AND id = $2", conversation_id, item_id
        )
        return json.loads(raw) if raw is not None else None

    async def add_conversation_items(
        self,
        conversation_id: str,
        items: list[dict[str, Any]],
        state: dict[str, Any] | None = None,
        from_version: int | None = None,
    ) -> StoredConversation | None:
        async with self._pool.acquire() as conn, conn.transaction():
            conversation = self._conversation(  # (locked: concurrent additions take turns)
                await conn.fetchrow("SELECT * FROM conversations WHERE id = $1 FOR UPDATE", conversation_id)
            )
            if conversation is None:
                return None
            await self._append_items(conn, conversation_id, items)
            conversation.version += 1
            if state is not None and from_version == conversation.version - 1:
                conversation.state = {**state, "version": conversation.version}
            await conn.execute(
                "UPDATE conversations SET version = $2, state = $3 WHERE id = $1",
                conversation_id,
                conversation.version,
                conversation.state_json(),
            )
            return conversation

    async def delete_conversation_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        async with self._pool.acquire() as conn, conn.transaction():
            deleted = await conn.execute(
                "DELETE FROM conversation_items WHERE conversation_id = $1 AND id = $2", conversation_id, item_id
            )
            if deleted == "DELETE 0":
                return None
            return self._conversation(
                await conn.fetchrow(
                    "UPDATE conversations SET version = version + 1 WHERE id = $1 RETURNING *", conversation_id
                )
            )
