"""Waiting on and finding the processes a server under test starts (its engine processes and
their workers, spawned by multiprocessing)."""

from __future__ import annotations

import time
from pathlib import Path


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn (not its resource tracker)."""
    try:
        pids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return [p for p in pids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):
    """`predicate()`'s first true value, polled every `poll` seconds; AssertionError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"{what} not within {timeout:.0f} s")
