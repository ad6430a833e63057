"""Where responses live after they are created: `GET`, `previous_response_id`, stream resume.

`ResponseStore` is the interface; `SQLiteResponseStore` is the embedded default (one file,
survives restarts), `agent_server.store_postgres.PostgresStore` the one several servers share
(`--store postgresql://...`): there a running response is owned by the server running it, which
other servers ask to stop it (`request_cancel`) and whose events they follow (`events_after`,
`changed`). A record holds the public `Response`, the request's input items, the
Harmony messages of the conversation so far (what `previous_response_id` continues from) and,
for background responses, the event stream so `?stream=true&starting_after=N` can replay it.

A stored response is written while it runs, not only when it ends (`run_journal`): its record
with the output so far, and a background response's events one batch at a time
(`append_events`, a table of their own, so appending does not rewrite the record). Responses
still running when the server stopped, however it stopped, read `failed` with that output when
it starts again.
Conversations (`/v1/conversations`) live beside responses, in tables of their own: a
conversation's items in order, and the Harmony state its last response left (`ConversationStore`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from agent_server.ownership import visible

log = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    id: str
    response: dict[str, Any]  # the Response as JSON
    input_items: list[dict[str, Any]]  # this request's input items, each with an id
    # Harmony messages (Message.to_dict()) after this response, system/developer excluded.
    conversation: list[dict[str, Any]] = field(default_factory=list)
    function_calls: dict[str, str] = field(default_factory=dict)  # call_id -> function name, whole chain
    # System/developer input messages of the whole chain: conversation items, unlike the
    # `instructions` parameter, so later responses keep them (in the one developer message).
    input_instructions: list[str] = field(default_factory=list)
    mcp_listed: list[str] = field(default_factory=list)  # server labels whose tools the chain has listed
    # Ids of the input and output items of the earlier responses of the chain (with this
    # record's own items, what a response continuing it may not be given again, as in OpenAI).
    chain_item_ids: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] | None = None  # the SSE stream, kept for background responses
    created_at: float = field(default_factory=time.time)
    owner: str | None = None  # the owner name of the API key that created it (auth.py)

    @property
    def status(self) -> str | None:
        return self.response.get("status")


RUNNING = ("queued", "in_progress")  # a stored response's statuses while a server runs it

# Called with (response_id, deleted) when another server asks to stop a run this one owns.
CancelHandler = Callable[[str, bool], None]


class ResponseStore(Protocol):
    async def get(self, response_id: str, events: bool = True) -> StoredResponse | None:
        """`events=False`: without a background response's events (its `events` stays [])."""

    async def find_item(self, item_id: str, requester: str | None = None) -> dict[str, Any] | None:
        """An input or output item of a stored response the requester may see (ownership.visible),
        by its id (`item_reference`)."""

    async def put(self, record: StoredResponse) -> None: ...

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """More of a (background) response's events, each with its sequence_number."""

    async def events_after(self, response_id: str, after: int) -> list[dict[str, Any]]:
        """Its stored events with sequence_number > after, in order."""

    async def changed(self, response_id: str, timeout: float) -> None:
        """Returns once its record or events may have changed, or after `timeout` seconds (for
        a client following a response that another server runs)."""

    async def request_cancel(self, response_id: str) -> bool:
        """Ask the server running it to cancel it; False when no other server runs it."""

    def set_cancel_handler(self, handler: CancelHandler) -> None:
        """Who is told when another server asks to stop (cancel, or delete) a run of this one."""

    def set_live_runs(self, live: Callable[[str], bool]) -> None:
        """Whether this server still runs the response of that id (its run registry): a record
        it owns, still running, with no run for a while (its final write failed) is marked failed."""

    async def delete(self, response_id: str) -> bool:
        """(A running response another server owns is stopped by it, and not stored.)"""

    async def close(self) -> None: ...


@dataclass
class StoredConversation:
    id: str
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    version: int = 0  # counts the changes to its items
    # What the model saw when the last response in it ended, as a StoredResponse's fields
    # (`conversation`, `function_calls`, `input_instructions`, `mcp_listed`) with the `version`
    # of the items it matches. Once items were added or deleted otherwise, it no longer
    # matches, and the items themselves are what a response continues from.
    state: dict[str, Any] | None = None
    owner: str | None = None  # the owner name of the API key that created it (auth.py)

    @property
    def current_state(self) -> dict[str, Any] | None:
        return self.state if self.state is not None and self.state.get("version") == self.version else None

    # Its row in a store's `conversations` table, as both backends keep it (metadata and state as JSON).
    COLUMNS = ("id", "created_at", "metadata", "version", "state", "owner")

    def row(self) -> tuple:
        """The values of COLUMNS."""
        return (self.id, self.created_at, json.dumps(self.metadata), self.version, self.state_json(), self.owner)

    def state_json(self) -> str | None:
        return json.dumps(self.state) if self.state else None

    @classmethod
    def from_row(cls, id, created_at, metadata, version, state, owner) -> StoredConversation:
        """The conversation a row of COLUMNS holds."""
        return cls(
            id=id,
            created_at=created_at,
            metadata=json.loads(metadata),
            version=version,
            state=json.loads(state) if state else None,
            owner=owner,
        )


class ConversationStore(Protocol):
    async def create_conversation(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None: ...

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None: ...

    async def update_conversation(
        self, conversation_id: str, metadata: dict[str, str]
    ) -> StoredConversation | None: ...

    async def delete_conversation(self, conversation_id: str) -> bool: ...

    async def conversation_items(
        self, conversation_id: str, *, after: str | None = None, limit: int | None = None, descending: bool = False
    ) -> list[dict[str, Any]] | None:
        """Its items in order (newest first when `descending`), those after `after` in that order,
        at most `limit`; None when it does not exist, KeyError when `after` is not one of them."""

    async def conversation_item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None: ...

    async def add_conversation_items(
        self,
        conversation_id: str,
        items: list[dict[str, Any]],
        state: dict[str, Any] | None = None,
        from_version: int | None = None,
    ) -> StoredConversation | None:
        """Append items (each with an id none of its items has: ValueError otherwise). `state`
        becomes its state if it was still at `from_version` (nothing else changed it since the
        response that brings the items began). None when it does not exist."""

    async def delete_conversation_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        """None when the conversation or the item does not exist."""


class SQLiteResponseStore:
    """Records as JSON in one SQLite table. Calls run in a worker thread, one at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _keep_private(self.path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False)
        with self._lock, self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at REAL, record TEXT NOT NULL)"
            )
            # Which responses hold each input and output item (`item_reference` finds them); an
            # item given again as input, by reference or whole, is in several.
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS response_items (id TEXT NOT NULL, response_id TEXT NOT NULL, "
                "PRIMARY KEY (id, response_id))"
            )
            self._db.execute("CREATE INDEX IF NOT EXISTS response_items_by_response ON response_items (response_id)")
            # The status, beside the record: startup finds the unfinished responses without reading
            # every record (a store written before the column existed gets it filled in once).
            if "status" not in [row[1] for row in self._db.execute("PRAGMA table_info(responses)")]:
                self._db.execute("ALTER TABLE responses ADD COLUMN status TEXT")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_by_status ON responses (status)")
            # Background responses' events, by sequence number (records written before this table
            # existed keep theirs in the record).
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS response_events (response_id TEXT NOT NULL, seq INTEGER "
                "NOT NULL, event TEXT NOT NULL, PRIMARY KEY (response_id, seq))"
            )
        self._create_conversation_tables()
        self._fill_in_statuses()
        self._open_existing()

    def _fill_in_statuses(self) -> None:
        """The status column of records stored before it existed, record by record (in Python, not
        with SQLite's json_extract, which older SQLite builds lack)."""
        with self._lock:
            ids = [row[0] for row in self._db.execute("SELECT id FROM responses WHERE status IS NULL")]
        for response_id in ids:
            with self._lock, self._db:
                row = self._db.execute("SELECT record FROM responses WHERE id = ?", (response_id,)).fetchone()
                status = json.loads(row[0]).get("response", {}).get("status") if row else None
                self._db.execute("UPDATE responses SET status = ? WHERE id = ?", (status or "unknown", response_id))

    def _open_existing(self) -> None:
        """Responses still running when the server last stopped will never finish: say so. A
        store written before the item index existed has its items indexed."""
        with self._lock:  # (by the status column: the store is not loaded, nor parsed, whole)
            rows = self._db.execute("SELECT record FROM responses WHERE status IN ('queued', 'in_progress')").fetchall()
            unindexed = self._db.execute("SELECT NOT EXISTS (SELECT 1 FROM response_items)").fetchone()[0]
        for (raw,) in rows:
            # (its events, in their table, stay as they are)
            self._put(interrupted(StoredResponse(**json.loads(raw))))
        if unindexed:  # once, record by record
            with self._lock:
                ids = [row[0] for row in self._db.execute("SELECT id FROM responses").fetchall()]
            for response_id in ids:
                record = self._get(response_id, events=False)
                if record is not None:
                    with self._lock, self._db:
                        self._index(record)

    def _put(self, record: StoredResponse) -> None:
        # The events go to their table; the record keeps [] to say it has some there.
        fields = asdict(record) | {"events": None if record.events is None else []}
        raw = json.dumps(fields, separators=(",", ":"))
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses (id, created_at, record, status) VALUES (?, ?, ?, ?)",
                (record.id, record.created_at, raw, record.status),
            )
            self._db.execute("DELETE FROM response_items WHERE response_id = ?", (record.id,))
            self._index(record)
            self._insert_events(record.id, record.events or [])

    def _insert_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        self._db.executemany(
            "INSERT OR IGNORE INTO response_events (response_id, seq, event) VALUES (?, ?, ?)",
            [(response_id, e["sequence_number"], json.dumps(e, separators=(",", ":"))) for e in events],
        )

    def _append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        with self._lock, self._db:
            self._insert_events(response_id, events)

    def _with_events(self, record: StoredResponse) -> StoredResponse:
        if record.events == []:
            with self._lock:
                rows = self._db.execute(
                    "SELECT event FROM response_events WHERE response_id = ? ORDER BY seq", (record.id,)
                ).fetchall()
            record.events = [json.loads(row[0]) for row in rows]
        return record

    def _index(self, record: StoredResponse) -> None:
        self._db.executemany(
            "INSERT OR IGNORE INTO response_items (id, response_id) VALUES (?, ?)",
            [(item_id, record.id) for item_id in record_item_ids(record)],
        )

    def _get(self, response_id: str, events: bool = True) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            return None
        record = StoredResponse(**json.loads(row[0]))
        return self._with_events(record) if events else record

    def _delete(self, response_id: str) -> bool:
        with self._lock, self._db:
            self._db.execute("DELETE FROM response_items WHERE response_id = ?", (response_id,))
            self._db.execute("DELETE FROM response_events WHERE response_id = ?", (response_id,))
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def _find_item(self, item_id: str, requester: str | None) -> dict[str, Any] | None:
        with self._lock:
            rows = self._db.execute(  # the newest response holding it first
                "SELECT i.response_id FROM response_items i JOIN responses r ON r.id = i.response_id "
                "WHERE i.id = ? ORDER BY r.created_at DESC",
                (item_id,),
            ).fetchall()
        for (response_id,) in rows:
            record = self._get(response_id, events=False)
            if record is None or not visible(record.owner, requester):
                continue
            found = next((item for item in record_items(record) if item.get("id") == item_id), None)
            if found is not None:
                return found
        return None

    def _events_after(self, response_id: str, after: int) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT event FROM response_events WHERE response_id = ? AND seq > ? ORDER BY seq", (response_id, after)
            ).fetchall()
        return [json.loads(row[0]) for row in rows]

    async def get(self, response_id: str, events: bool = True) -> StoredResponse | None:
        return await asyncio.to_thread(self._get, response_id, events)

    async def events_after(self, response_id: str, after: int) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._events_after, response_id, after)

    async def changed(self, response_id: str, timeout: float) -> None:
        # One server runs what it stores: only a process sharing the file writes meanwhile.
        await asyncio.sleep(min(timeout, 0.2))

    async def request_cancel(self, response_id: str) -> bool:
        return False  # (no other server: its runs are this one's)

    def set_cancel_handler(self, handler: CancelHandler) -> None:
        pass

    def set_live_runs(self, live: Callable[[str], bool]) -> None:
        pass  # (its running records are failed when it next opens)

    async def put(self, record: StoredResponse) -> None:
        await asyncio.to_thread(self._put, record)

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self._append_events, response_id, events)

    async def find_item(self, item_id: str, requester: str | None = None) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._find_item, item_id, requester)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, response_id)

    async def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- conversations ------------------------------------------------------------------------

    def _create_conversation_tables(self) -> None:
        with self._lock, self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS conversations (id TEXT PRIMARY KEY, created_at REAL, "
                "metadata TEXT NOT NULL, version INTEGER NOT NULL, state TEXT, owner TEXT)"
            )
            # (a store written before conversations had owners gets the column; theirs stay NULL)
            if "owner" not in [row[1] for row in self._db.execute("PRAGMA table_info(conversations)")]:
                self._db.execute("ALTER TABLE conversations ADD COLUMN owner TEXT")
            # An item's place in its conversation: `position` orders them (gaps where items were deleted).
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS conversation_items (conversation_id TEXT NOT NULL, "
                "position INTEGER NOT NULL, id TEXT NOT NULL, item TEXT NOT NULL, "
                "PRIMARY KEY (conversation_id, position))"
            )
            self._db.execute(
                "CREATE UNIQUE INDEX IF NOT EXISTS conversation_items_by_id ON conversation_items (conversation_id, id)"
            )

    def _conversation_row(self, conversation_id: str) -> StoredConversation | None:
        row = self._db.execute(
            f"SELECT {', '.join(StoredConversation.COLUMNS)} FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return None if row is None else StoredConversation.from_row(*row)

    def _append_items(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        ids = [item["id"] for item in items]
        if len(set(ids)) != len(ids):
            raise ValueError("the items' ids are not unique")
        taken = (
            self._db.execute(
                f"SELECT id FROM conversation_items WHERE conversation_id = ? AND id IN ({','.join('?' * len(ids))})",
                (conversation_id, *ids),
            ).fetchall()
            if ids
            else []
        )
        if taken:
            raise ValueError(f"the conversation already holds an item with id '{taken[0][0]}'")
        last = self._db.execute(
            "SELECT MAX(position) FROM conversation_items WHERE conversation_id = ?", (conversation_id,)
        ).fetchone()[0]
        start = 0 if last is None else last + 1
        self._db.executemany(
            "INSERT INTO conversation_items (conversation_id, position, id, item) VALUES (?, ?, ?, ?)",
            [
                (conversation_id, start + n, item["id"], json.dumps(item, separators=(",", ":")))
                for n, item in enumerate(items)
            ],
        )

    def _create_conversation(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO conversations (id, created_at, metadata, version, state, owner) VALUES (?, ?, ?, ?, ?, ?)",
                conversation.row(),
            )
            self._append_items(conversation.id, items)

    def _get_conversation(self, conversation_id: str) -> StoredConversation | None:
        with self._lock:
            return self._conversation_row(conversation_id)

    def _update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None:
        with self._lock, self._db:
            self._db.execute(
                "UPDATE conversations SET metadata = ? WHERE id = ?", (json.dumps(metadata), conversation_id)
            )
            return self._conversation_row(conversation_id)

    def _delete_conversation(self, conversation_id: str) -> bool:
        with self._lock, self._db:
            self._db.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
            return self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount > 0

    def _conversation_items(
        self, conversation_id: str, after: str | None, limit: int | None, descending: bool
    ) -> list[dict[str, Any]] | None:
        order, beyond = ("DESC", "<") if descending else ("ASC", ">")
        with self._lock:
            if self._conversation_row(conversation_id) is None:
                return None
            query, args = "SELECT item FROM conversation_items WHERE conversation_id = ?", [conversation_id]
            if after is not None:
                row = self._db.execute(
                    "SELECT position FROM conversation_items WHERE conversation_id = ? AND id = ?",
                    (conversation_id, after),
                ).fetchone()
                if row is None:
                    raise KeyError(after)
                query += f" AND position {beyond} ?"
                args.append(row[0])
            query += f" ORDER BY position {order}"
            if limit is not None:
                query += " LIMIT ?"
                args.append(limit)
            return [json.loads(raw) for (raw,) in self._db.execute(query, args).fetchall()]

    def _conversation_item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT item FROM conversation_items WHERE conversation_id = ? AND id = ?", (conversation_id, item_id)
            ).fetchone()
        return json.loads(row[0]) if row else None

    def _add_conversation_items(
        self, conversation_id: str, items: list[dict[str, Any]], state: dict[str, Any] | None, from_version: int | None
    ) -> StoredConversation | None:
        with self._lock, self._db:
            conversation = self._conversation_row(conversation_id)
            if conversation is None:
                return None
            self._append_items(conversation_id, items)
            conversation.version += 1
            if state is not None and from_version == conversation.version - 1:
                conversation.state = {**state, "version": conversation.version}
            self._db.execute(
                "UPDATE conversations SET version = ?, state = ? WHERE id = ?",
                (conversation.version, conversation.state_json(), conversation_id),
            )
            return conversation

    def _delete_conversation_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        with self._lock, self._db:
            deleted = self._db.execute(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND id = ?", (conversation_id, item_id)
            ).rowcount
            if not deleted:
                return None
            self._db.execute("UPDATE conversations SET version = version + 1 WHERE id = ?", (conversation_id,))
            return self._conversation_row(conversation_id)

    async def create_conversation(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self._create_conversation, conversation, items)

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        return await asyncio.to_thread(self._get_conversation, conversation_id)

    async def update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None:
        return await asyncio.to_thread(self._update_conversation, conversation_id, metadata)

    async def delete_conversation(self, conversation_id: str) -> bool:
        return await asyncio.to_thread(self._delete_conversation, conversation_id)

    async def conversation_items(
        self, conversation_id: str, *, after: str | None = None, limit: int | None = None, descending: bool = False
    ) -> list[dict[str, Any]] | None:
        return await asyncio.to_thread(self._conversation_items, conversation_id, after, limit, descending)

    async def conversation_item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._conversation_item, conversation_id, item_id)

    async def add_conversation_items(
        self,
        conversation_id: str,
        items: list[dict[str, Any]],
        state: dict[str, Any] | None = None,
        from_version: int | None = None,
    ) -> StoredConversation | None:
        return await asyncio.to_thread(self._add_conversation_items, conversation_id, items, state, from_version)

    async def delete_conversation_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        return await asyncio.to_thread(self._delete_conversation_item, conversation_id, item_id)


def _keep_private(path: Path) -> None:
    """The store holds every prompt and answer: its file is created readable by its owner only,
    and an existing one (with its WAL and shared-memory files) is made so. SQLite gives the WAL
    and shared-memory files it creates the database file's mode, so creating the file first is
    enough (a umask change would be process-wide, and other threads create files too)."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))  # (an empty file is an empty database)
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")):
        try:
            if name.exists() and name.stat().st_mode & 0o077:
                os.chmod(name, 0o600)
        except OSError as e:  # (not our file): serve anyway, but say so
            log.warning("could not make %s readable by its owner only: %s", name, e)


async def settled(store: ResponseStore, response_id: str, timeout: float) -> StoredResponse | None:
    """The stored response (without its events) once it is no longer running, or as it is
    after `timeout` seconds; None once deleted. For a response another server runs (or ran:
    when its owner died, a server marks it failed within the store's lease)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        record = await store.get(response_id, events=False)
        left = deadline - loop.time()
        if record is None or record.status not in RUNNING or left <= 0:
            return record
        await store.changed(response_id, min(left, 1.0))


def interrupted(record: StoredResponse) -> StoredResponse:
    """A response whose server stopped while it ran, as it is then stored: failed, with the
    output written until then."""
    record.response["status"] = "failed"
    record.response["error"] = {
        "code": "server_error",
        "message": "The server stopped before this response finished.",
    }
    for item in record.response.get("output", []):  # what was being written when it stopped
        if item.get("status") == "in_progress":
            item["status"] = "incomplete"
    return record


def record_items(record: StoredResponse) -> list[dict[str, Any]]:
    """A record's input items, then its output items."""
    return [*record.input_items, *record.response.get("output", [])]


def record_item_ids(record: StoredResponse) -> set[str]:
    return {item["id"] for item in record_items(record) if isinstance(item.get("id"), str)}
