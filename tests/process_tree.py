"""Waiting on and finding the processes a server under test starts (its engine processes and
their workers, spawned by multiprocessing)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


@contextlib.contextmanager
def serve_process(tmp_path: Path, *args: str, ready_timeout: float = 300.0):
    """`oss-agent serve *args` as a process of its own on a free port, its log in
    tmp_path/serve.log, waited for until /ready answers 200; yields (process, base URL, log
    path). At the end its engine processes and their workers are killed, then it is stopped."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_server.cli", "serve", "--port", str(port), *args],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    base = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log_path.read_text()}")
        try:
            return httpx.get(f"{base}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, ready_timeout, "the server ready", poll=0.5)
        yield proc, base, log_path
    finally:
        for pid in [p for e in spawned_children(proc.pid) for p in [*spawned_children(e), e]]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
