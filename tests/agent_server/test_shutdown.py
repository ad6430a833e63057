"""Graceful shutdown under load: stop accepting, let in-flight work finish within the deadline,
cancel what cannot, and have every response's final state in the store when the process ends.

The scripted engine paces tokens (`token_delay`), so each response's length in seconds is known:
quick ones finish inside the grace period, medium background ones inside the drain deadline
that follows it, slow ones never. The store file is read back raw after the server has stopped.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx
import pytest

from inference.tokenizer import harmony_encoding
from tests.conftest import MODEL, LiveServer, build_tiny_engine, make_app
from tests.fake_engine import ScriptedEngine, harmony_tokens

TOKEN_DELAY = 0.01
GRACE = 1.0  # uvicorn: seconds open connections get
DRAIN = 3.0  # the app: seconds running responses get after that
SECONDS = {"quick": 0.4, "medium": 2.0, "slow": 60.0}


def paced_turn(request) -> list[int]:
    """A final answer as long as the prompt's keyword says, in tokens at TOKEN_DELAY each."""
    prompt = harmony_encoding().decode(request.prompt_token_ids)
    kind = next(k for k in SECONDS if f"please be {k}" in prompt)
    words = int(SECONDS[kind] / TOKEN_DELAY)
    return harmony_tokens("<|channel|>final<|message|>" + "go " * words + "<|return|>")


def stored(db_path) -> dict[str, dict]:
    with sqlite3.connect(db_path) as db:
        return {rid: json.loads(raw)["response"] for rid, raw in db.execute("SELECT id, record FROM responses")}


@pytest.mark.slow
def test_shutdown_under_load_finishes_or_cancels_and_loses_nothing(tmp_path):
    engine = ScriptedEngine(token_delay=TOKEN_DELAY)
    engine.say(*[paced_turn] * 64)
    db = tmp_path / "r.db"
    server = LiveServer(make_app(lambda: engine, db, shutdown_timeout=DRAIN)).start()
    server.server.config.timeout_graceful_shutdown = GRACE
    url = server.url

    def body(kind, **extra):
        return {"model": MODEL, "input": f"please be {kind}", **extra}

    background = {
        kind: [httpx.post(f"{url}/v1/responses", json=body(kind, background=True)).json()["id"] for _ in range(3)]
        for kind in SECONDS
    }
    foreground: dict[str, list] = {"quick": [], "slow": []}
    errors: list[Exception] = []

    def plain(kind):
        try:
            foreground[kind].append(httpx.post(f"{url}/v1/responses", json=body(kind), timeout=30))
        except httpx.HTTPError as e:  # the slow ones are cut off when the grace period ends
            errors.append(e)

    def streamed():
        ids = []
        try:
            with httpx.stream("POST", f"{url}/v1/responses", json=body("slow", stream=True), timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and not ids:
                        ids.append(json.loads(line[5:])["response"]["id"])
        except httpx.HTTPError as e:
            errors.append(e)
        foreground["slow"].append(ids[0] if ids else None)

    threads = [threading.Thread(target=plain, args=(k,)) for k in ("quick", "quick", "slow")]
    threads += [threading.Thread(target=streamed) for _ in range(2)]
    for t in threads:
        t.start()
    total = sum(map(len, background.values())) + len(threads)
    # Every request has reached the engine: the slow ones (60 s) are generating, so the server is
    # under load; quick and medium ones may already be done on a slow machine, which the checks
    # below allow.
    deadline = time.monotonic() + 30
    while len(engine.calls) < total:
        assert time.monotonic() < deadline, f"{len(engine.calls)} of {total} requests reached the engine"
        time.sleep(0.01)
    assert engine.running >= len(background["slow"]) + 3  # 3 background + 1 plain + 2 streamed

    started = time.monotonic()
    server.server.should_exit = True
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(f"{url}/health", timeout=2)
    server.thread.join(timeout=30)
    took = time.monotonic() - started
    for t in threads:
        t.join(timeout=10)
    assert not server.thread.is_alive()
    assert took < GRACE + DRAIN + 3, took  # the deadline holds: slow work did not hold the process up

    # Foreground requests in flight: quick ones completed for their clients, slow ones were cut off.
    quick = foreground["quick"]
    assert len(quick) == 2 and all(r.status_code == 200 and r.json()["status"] == "completed" for r in quick)
    assert len(errors) == 2  # the slow streams were cut off mid-stream...
    (cut,) = [r for r in foreground["slow"] if isinstance(r, httpx.Response)]  # ...the plain one got a 503
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "server_shutting_down"
    foreground["slow"].remove(cut)

    records = stored(db)
    # Nothing lost: every response the server created is in the store, none left in progress.
    created = {rid for ids in background.values() for rid in ids} | {r.json()["id"] for r in quick}
    created |= {rid for rid in foreground["slow"] if rid}
    assert len(foreground["slow"]) == 2 and all(foreground["slow"])
    assert created <= set(records)
    assert len(records) == total  # including the slow plain request the client never heard back about
    assert all(r["status"] in ("completed", "cancelled") for r in records.values()), records
    for kind in ("quick", "medium"):  # finished inside the grace period or the drain deadline
        assert all(records[rid]["status"] == "completed" for rid in background[kind])
        assert all(records[rid]["output"][0]["content"][0]["text"].startswith("go go") for rid in background[kind])
    assert all(records[rid]["status"] == "cancelled" for rid in background["slow"])
    assert all(records[rid]["status"] == "cancelled" for rid in foreground["slow"])
    assert engine.running == 0 and engine.shut_down


@pytest.mark.slow
def test_shutdown_on_the_real_engine_stores_every_response(tmp_path, tiny_checkpoint):
    """The same on the tiny model: long background generations are cancelled at the deadline,
    short ones complete, the engine ends with nothing running and the store has them all."""
    engine = build_tiny_engine(tiny_checkpoint)
    db = tmp_path / "r.db"
    server = LiveServer(make_app(lambda: engine, db, shutdown_timeout=0.5), kind="tiny").start()
    server.server.config.timeout_graceful_shutdown = GRACE
    short = [
        httpx.post(
            f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "temperature": 0}
        ).json()
        for _ in range(2)
    ]
    assert all(r["status"] in ("completed", "incomplete") for r in short)
    long = [
        httpx.post(
            f"{server.url}/v1/responses",
            json={"model": MODEL, "input": f"tell me {i}", "background": True, "max_output_tokens": 900},
        ).json()["id"]
        for i in range(3)
    ]
    deadline = time.monotonic() + 60
    while engine.stats().running < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.server.should_exit = True
    server.thread.join(timeout=60)
    assert not server.thread.is_alive()
    records = stored(db)
    assert {r["id"] for r in short} | set(long) == set(records)
    assert [records[rid]["status"] for rid in long] == ["cancelled"] * 3
    assert all(records[r["id"]]["status"] == r["status"] for r in short)
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.pages_used == 0


def test_a_stream_finishing_within_the_grace_period_finishes_after_sigterm(tmp_path):
    # What a SIGTERM does to uvicorn (sse-starlette hooks the same handler): a stream that
    # needs less than the grace period ends with its last event, not cut off.
    import signal

    from sse_starlette.sse import AppStatus

    engine = ScriptedEngine(token_delay=TOKEN_DELAY)
    engine.say(paced_turn)
    server = LiveServer(make_app(lambda: engine, tmp_path / "r.db", shutdown_timeout=DRAIN)).start()
    server.server.config.timeout_graceful_shutdown = 5.0
    kinds: list[str] = []
    try:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/responses",
            timeout=30,
            json={"model": MODEL, "input": "please be medium", "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("event:"):
                    kinds.append(line[6:].strip())
                    if len(kinds) == 1:
                        server.server.handle_exit(signal.SIGTERM, None)
        server.thread.join(timeout=20)
    finally:
        AppStatus.should_exit = False  # (process-wide in sse-starlette: set by a drain it did)
        server.stop()
    assert kinds[-1] == "response.completed", kinds[-3:]
    assert not server.thread.is_alive()
