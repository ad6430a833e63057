"""The response store on disk: who can read it, and what a crash leaves in it.

The store holds every prompt and answer, so its file, WAL and shared-memory files are readable
by their owner only, whatever the umask. A server killed with SIGKILL mid-generation loses
nothing a client was told about: a foreground stream's response reads `failed` after the
restart, with the text generated before the kill, and a background response's stream replays
the events it had sent, with their original sequence numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agent_server.store import SQLiteResponseStore, StoredResponse
from tests.conftest import MODEL, wait_for
from tests.scripted_server import long_answer


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_store_files_are_readable_by_their_owner_only(tmp_path):
    old = os.umask(0o022)  # the usual umask: files are created world-readable unless asked otherwise
    try:
        path = tmp_path / "store" / "r.db"
        store = SQLiteResponseStore(path)
        asyncio.run(
            store.put(StoredResponse(id="resp_1", response={"id": "resp_1", "status": "completed"}, input_items=[]))
        )
        for name in (path, f"{path}-wal", f"{path}-shm"):
            assert os.path.exists(name), name
            assert mode(name) == 0o600, (name, oct(mode(name)))
        assert mode(path.parent) == 0o700  # the folder it created for it, too
        asyncio.run(store.close())
    finally:
        os.umask(old)


def test_an_existing_world_readable_store_is_made_private(tmp_path):
    path = tmp_path / "r.db"
    store = SQLiteResponseStore(path)
    asyncio.run(
        store.put(StoredResponse(id="resp_1", response={"id": "resp_1", "status": "completed"}, input_items=[]))
    )
    asyncio.run(store.close())
    os.chmod(path, 0o644)
    for name in (f"{path}-wal", f"{path}-shm"):
        if os.path.exists(name):
            os.chmod(name, 0o644)
    reopened = SQLiteResponseStore(path)
    assert asyncio.run(reopened.get("resp_1")).status == "completed"
    for name in (path, f"{path}-wal", f"{path}-shm"):
        if os.path.exists(name):
            assert mode(name) == 0o600, (name, oct(mode(name)))
    asyncio.run(reopened.close())


# --- a crash mid-generation -------------------------------------------------------------------


def start_server(store: Path | str) -> tuple[subprocess.Popen, str]:
    """`tests.scripted_server` on `store` (a SQLite file or a PostgreSQL URL), in a process of
    its own; (process, base URL)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.scripted_server", str(store)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("READY "), line
    return process, line.split()[1]


def read_events(lines, deltas: int) -> list[dict]:
    """Events of an open stream (the iterator of its lines, kept open after this returns: a
    closed iterator closes the connection), up to and including the `deltas`-th text delta."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            events.append(json.loads(line[5:]))
            if sum(e["type"] == "response.output_text.delta" for e in events) == deltas:
                return events
    raise AssertionError(f"the stream ended early: {events[-1:]}")


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@pytest.mark.slow
def test_responses_cut_by_a_kill_read_failed_with_what_was_generated(tmp_path, store_url):
    # On PostgreSQL the next server marks them failed once the killed one's lease ran out.
    store = store_url or tmp_path / "r.db"
    server, url = start_server(store)
    try:
        with contextlib.ExitStack() as streams:
            # A stored foreground stream and a background one, each read for a while.
            foreground = streams.enter_context(
                httpx.stream(
                    "POST", f"{url}/v1/responses", json={"model": MODEL, "input": "tell me", "stream": True}, timeout=60
                )
            )
            foreground_lines = foreground.iter_lines()
            seen_foreground = read_events(foreground_lines, 30)
            background = streams.enter_context(
                httpx.stream(
                    "POST",
                    f"{url}/v1/responses",
                    json={"model": MODEL, "input": "and me", "stream": True, "background": True},
                    timeout=60,
                )
            )
            background_lines = background.iter_lines()
            seen_background = read_events(background_lines, 30)
            time.sleep(1.5)  # they go on generating (a token every 10 ms) and are written meanwhile
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
    fg_id, bg_id = seen_foreground[0]["response"]["id"], seen_background[0]["response"]["id"]
    answer = long_answer()

    server, url = start_server(store)  # the same store, after the crash
    try:
        # The foreground response the client holds the id of: failed, with what was generated.
        wait_for(lambda: httpx.get(f"{url}/v1/responses/{bg_id}").json()["status"] == "failed")
        r = httpx.get(f"{url}/v1/responses/{fg_id}")
        assert r.status_code == 200, r.text  # (it was never stored: a 404 for an id the client holds)
        stored = r.json()
        assert stored["status"] == "failed" and stored["error"]["code"] == "server_error", stored
        (message,) = stored["output"]
        assert message["status"] == "incomplete"
        text = message["content"][0]["text"]
        assert text.startswith(text_of(seen_foreground)) and answer.startswith(text)
        assert len(text) > len(text_of(seen_foreground))  # (written after the client's last read, too)
        items = httpx.get(f"{url}/v1/responses/{fg_id}/input_items").json()["data"]
        assert items[0]["content"][0]["text"] == "tell me"

        # The background response: failed with its text, and its stream replays the events it
        # had sent, with their sequence numbers, then ends with its terminal event.
        stored = httpx.get(f"{url}/v1/responses/{bg_id}").json()
        assert stored["status"] == "failed" and answer.startswith(stored["output"][0]["content"][0]["text"])
        with httpx.stream("GET", f"{url}/v1/responses/{bg_id}", params={"stream": "true"}, timeout=60) as replay:
            replayed = [json.loads(line[5:]) for line in replay.iter_lines() if line.startswith("data:")]
        assert [e["sequence_number"] for e in replayed] == list(range(len(replayed)))
        assert replayed[: len(seen_background)] == seen_background
        assert len(replayed) > len(seen_background) + 1
        assert replayed[-1]["type"] == "response.failed" and replayed[-1]["response"]["status"] == "failed"
        assert answer.startswith(text_of(replayed))
        with httpx.stream(
            "GET", f"{url}/v1/responses/{bg_id}", params={"stream": "true", "starting_after": 10}, timeout=60
        ) as replay:
            resumed = [json.loads(line[5:]) for line in replay.iter_lines() if line.startswith("data:")]
        assert resumed == replayed[11:]
        # Deleting it deletes its events too.
        assert httpx.delete(f"{url}/v1/responses/{bg_id}").status_code == 200
        assert httpx.get(f"{url}/v1/responses/{bg_id}").status_code == 404
    finally:
        server.kill()
        server.wait(timeout=30)
    if store_url is None:
        with sqlite3.connect(store) as db:
            count = db.execute("SELECT COUNT(*) FROM response_events WHERE response_id = ?", (bg_id,)).fetchone()[0]
    else:
        count = asyncio.run(_count_events(store_url, bg_id))
    assert count == 0


async def _count_events(url: str, response_id: str) -> int:
    import asyncpg

    db = await asyncpg.connect(url)
    try:
        return await db.fetchval("SELECT COUNT(*) FROM response_events WHERE response_id = $1", response_id)
    finally:
        await db.close()
