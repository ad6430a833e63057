"""A server on the scripted engine in a process of its own, for tests that kill it:
`python -m tests.scripted_server STORE [TOKEN_DELAY]` serves on a free loopback port, prints
`READY <url>` once it answers, and runs until it is killed. Every response is a long final
answer (`long_answer`), a token every TOKEN_DELAY seconds (default 0.01)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.conftest import LiveServer, make_app
from tests.fake_engine import ScriptedEngine, harmony_tokens

WORDS = 2000


def long_answer() -> str:
    return "".join(f"word{i} " for i in range(WORDS))


def main() -> None:
    store = Path(sys.argv[1])
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    engine = ScriptedEngine(token_delay=delay)
    turn = harmony_tokens(f"<|channel|>final<|message|>{long_answer()}<|return|>")
    engine.say(*[turn] * 1000)
    server = LiveServer(make_app(lambda: engine, store)).start()
    print(f"READY {server.url}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
