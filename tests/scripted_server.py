"""A server on the scripted engine in a process of its own, for tests that kill it:
`python -m tests.scripted_server STORE [TOKEN_DELAY]` serves on a free loopback port, prints
`READY <url>` once it answers, and runs until it is killed. Every response is a long final
answer (`long_answer`), a token every TOKEN_DELAY seconds (default 0.01). STORE is a SQLite
file or a PostgreSQL URL (then with short leases: `shared_store`)."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import LiveServer, make_app, shared_store
from tests.fake_engine import ScriptedEngine, harmony_tokens

WORDS = 2000


def long_answer() -> str:
    return "".join(f"word{i} " for i in range(WORDS))


def main() -> None:
    store = sys.argv[1]
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    engine = ScriptedEngine(token_delay=delay)
    turn = harmony_tokens(f"<|channel|>final<|message|>{long_answer()}<|return|>")
    engine.say(*[turn] * 1000)
    if store.startswith("postgresql://"):
        app = make_app(lambda: engine, Path(tempfile.mkdtemp()) / "unused.sqlite3", store=shared_store(store))
    else:
        app = make_app(lambda: engine, Path(store))
    server = LiveServer(app).start()
    print(f"READY {server.url}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
