"""The response store on disk: who can read it, and what a crash leaves in it.

The store holds every prompt and answer, so its file, WAL and shared-memory files are readable
by their owner only, whatever the umask. A server killed with SIGKILL mid-generation loses
nothing a client was told about: a foreground stream's response reads `failed` after the
restart, with the text generated before the kill, and a background response's stream replays
the events it had sent, with their original sequence numbers.
"""

from __future__ import annotations

import asyncio
import os
import stat

from agent_server.store import SQLiteResponseStore, StoredResponse


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_store_files_are_readable_by_their_owner_only(tmp_path):
    old = os.umask(0o022)  # the usual umask: files are created world-readable unless asked otherwise
    try:
        path = tmp_path / "store" / "r.db"
        store = SQLiteResponseStore(path)
        asyncio.run(store.put(StoredResponse(id="resp_1", response={"id": "resp_1", "status": "completed"},
                                             input_items=[])))
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
    asyncio.run(store.put(StoredResponse(id="resp_1", response={"id": "resp_1", "status": "completed"},
                                         input_items=[])))
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
