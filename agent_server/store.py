"""Where responses live after they are created: `GET`, `previous_response_id`, stream resume.

`ResponseStore` is the interface; `SQLiteResponseStore` is the embedded default (one file,
survives restarts). A record holds the public `Response`, the request's input items, the
Harmony messages of the conversation so far (what `previous_response_id` continues from) and,
for background responses, the event stream so `?stream=true&starting_after=N` can replay it.

A stored response is written while it runs, not only when it ends (`run_journal`): its record
with the output so far, and a background response's events one batch at a time
(`append_events`, a table of their own, so appending does not rewrite the record). Responses
still running when the server stopped, however it stopped, read `failed` with that output when
it starts again.
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
from typing import Any, Protocol

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


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def find_item(self, item_id: str, requester: str | None = None) -> dict[str, Any] | None:
        """An input or output item of a stored response the requester may see (ownership.visible),
        by its id (`item_reference`)."""

    async def put(self, record: StoredResponse) -> None: ...

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """More of a (background) response's events, each with its sequence_number."""

    async def delete(self, response_id: str) -> bool: ...

    async def close(self) -> None: ...


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
            self._db.execute("CREATE TABLE IF NOT EXISTS response_items (id TEXT NOT NULL, response_id TEXT NOT NULL, "
                             "PRIMARY KEY (id, response_id))")
            self._db.execute("CREATE INDEX IF NOT EXISTS response_items_by_response ON response_items (response_id)")
            # The status, beside the record: startup finds the unfinished responses without reading
            # every record (a store written before the column existed gets it filled in once).
            if "status" not in [row[1] for row in self._db.execute("PRAGMA table_info(responses)")]:
                self._db.execute("ALTER TABLE responses ADD COLUMN status TEXT")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_by_status ON responses (status)")
            # Background responses' events, by sequence number (records written before this table
            # existed keep theirs in the record).
            self._db.execute("CREATE TABLE IF NOT EXISTS response_events (response_id TEXT NOT NULL, seq INTEGER "
                             "NOT NULL, event TEXT NOT NULL, PRIMARY KEY (response_id, seq))")
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
            record = StoredResponse(**json.loads(raw))  # (its events, in their table, stay as they are)
            record.response["status"] = "failed"
            record.response["error"] = {"code": "server_error", "message": "The server stopped before this "
                                        "response finished."}
            for item in record.response.get("output", []):  # what was being written when it stopped
                if item.get("status") == "in_progress":
                    item["status"] = "incomplete"
            self._put(record)
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
        self._db.executemany("INSERT OR IGNORE INTO response_events (response_id, seq, event) VALUES (?, ?, ?)",
                             [(response_id, e["sequence_number"], json.dumps(e, separators=(",", ":")))
                              for e in events])

    def _append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        with self._lock, self._db:
            self._insert_events(response_id, events)

    def _with_events(self, record: StoredResponse) -> StoredResponse:
        if record.events == []:
            with self._lock:
                rows = self._db.execute("SELECT event FROM response_events WHERE response_id = ? ORDER BY seq",
                                        (record.id,)).fetchall()
            record.events = [json.loads(row[0]) for row in rows]
        return record

    def _index(self, record: StoredResponse) -> None:
        self._db.executemany("INSERT OR IGNORE INTO response_items (id, response_id) VALUES (?, ?)",
                             [(item_id, record.id) for item_id in _item_ids(record)])

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
                "WHERE i.id = ? ORDER BY r.created_at DESC", (item_id,)).fetchall()
        for (response_id,) in rows:
            record = self._get(response_id, events=False)
            if record is None or not visible(record.owner, requester):
                continue
            found = next((item for item in _items(record) if item.get("id") == item_id), None)
            if found is not None:
                return found
        return None

    async def get(self, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self._get, response_id)

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


def _items(record: StoredResponse) -> list[dict[str, Any]]:
    """A record's input items, then its output items."""
    return [*record.input_items, *record.response.get("output", [])]


def _item_ids(record: StoredResponse) -> set[str]:
    return {item["id"] for item in _items(record) if isinstance(item.get("id"), str)}
