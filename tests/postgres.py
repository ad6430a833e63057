"""A throwaway PostgreSQL server for the store tests: `initdb` in a temporary folder, `pg_ctl`
on a free loopback port, a fresh database per test, everything removed at the end.

The binaries are looked for on PATH, in /usr/local/bin and in /usr/lib/postgresql/*/bin
(Debian's `postgresql` package, which `.ci/run` installs). Without them, or without asyncpg,
the tests that need PostgreSQL skip, saying why; under CI (CI=true) they fail instead, so
that the PostgreSQL backend is never silently left untested there.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def binaries() -> Path | None:
    """The folder holding initdb, pg_ctl and psql (the newest version's), or None."""
    candidates = []
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    candidates.append(Path("/usr/local/bin"))
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _version(p.parent.name), reverse=True)
    candidates += versions
    for folder in candidates:
        if all((folder / name).exists() for name in ("initdb", "pg_ctl", "postgres", "psql")):
            return folder
    return None


def _version(name: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in name.split("."))
    except ValueError:
        return (0,)


def unavailable(reason: str):
    """Skip, saying why; under CI, fail."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL tests cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """initdb + pg_ctl on a temporary folder. As root (CI's machines), the server runs as the
    `postgres` user (or `nobody`): PostgreSQL refuses to run as root."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="oss-agent-pg-"))  # (not pytest's tmp: root-only)
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.user: dict = {}
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                try:
                    account = pwd.getpwnam(name)
                except KeyError:
                    continue
                self.user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
                os.chown(self.root, account.pw_uid, account.pw_gid)
                break
        self._databases = itertools.count()

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
            env={**os.environ, "LC_ALL": "C", "PGTZ": "UTC"},
            **self.user,
        )

    def start(self) -> PostgresServer:
        done = self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr or done.stdout}")
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stderr or done.stdout}\n{log}")
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; its URL."""
        name = f"test_{next(self._databases)}"
        done = self._run(
            "psql", "-X", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-c", f"CREATE DATABASE {name}"
        )
        if done.returncode != 0:
            raise RuntimeError(f"CREATE DATABASE failed: {done.stderr}")
        return self.url(name)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """A running throwaway server, or a skip (a failure under CI) saying why there is none."""
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        unavailable("the asyncpg package is not installed (pip install asyncpg)")
    bin_dir = binaries()
    if bin_dir is None:
        unavailable(
            "PostgreSQL is not installed: no initdb/pg_ctl/postgres/psql on PATH, in /usr/local/bin "
            "or /usr/lib/postgresql/*/bin (apt-get install postgresql)"
        )
    server = PostgresServer(bin_dir)
    try:
        return server.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        server.stop()
        pytest.fail(f"a throwaway PostgreSQL server could not be started: {e}", pytrace=False)
