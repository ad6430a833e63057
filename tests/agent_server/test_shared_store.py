"""Several servers on one PostgreSQL database (`--store postgresql://...`), as behind a load
balancer: a chain whose turns alternate between them, a background stream resumed on the
other server, a background run cancelled from the other server, a run whose server died
marked failed by the other, and `oss-agent serve --store postgresql://...` itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time

import httpx
import pytest

from tests.agent_server.responses.test_routes import prompt_text
from tests.agent_server.test_store_durability import read_events, start_server, text_of
from tests.conftest import MODEL, LiveServer, make_app, serve_captured, shared_store, wait_for
from tests.fake_engine import ScriptedEngine
from tests.scripted_server import long_answer

pytestmark = pytest.mark.slow  # a long end-to-end run: CI runs it with `-m slow`

LONG = f"<|channel|>final<|message|>{long_answer()}<|return|>"


@pytest.fixture
def two_servers(tmp_path, postgres_url):
    """Two servers on one database, each with its own scripted engine (a token every 5 ms)."""
    servers = []
    for name in ("a", "b"):
        engine = ScriptedEngine(token_delay=0.005)
        app = make_app(
            lambda engine=engine: engine, tmp_path / name / "unused.sqlite3", store=shared_store(postgres_url)
        )
        servers.append(LiveServer(app).start())
    yield servers
    for server in servers:
        server.stop()


def events_of(response: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_a_chain_alternates_between_servers(two_servers):
    a, b = two_servers
    turns = [(a, "One"), (b, "Two"), (a, "Three"), (b, "Four")]
    previous = None
    for n, (server, word) in enumerate(turns):
        server.engine.say(f"<|channel|>final<|message|>Answer {word}.<|return|>")
        client = server.client()
        if n == 3:  # streamed: the next turn may come as soon as its last event is out
            with client.responses.stream(model=MODEL, input=f"Say {word}", previous_response_id=previous) as stream:
                response = stream.get_final_response()
        else:
            response = client.responses.create(model=MODEL, input=f"Say {word}", previous_response_id=previous)
        assert response.output_text == f"Answer {word}."
        prompt = prompt_text(server.engine.calls[-1])
        for earlier in [w for _, w in turns[:n]]:  # the whole chain, whichever server ran each turn
            assert f"Say {earlier}" in prompt and f"Answer {earlier}." in prompt
        previous = response.id
    # Each server answers for any response of the chain, and its input items.
    assert b.client().responses.retrieve(previous).output_text == "Answer Four."
    assert a.client().responses.retrieve(previous).output_text == "Answer Four."
    items = a.client().responses.input_items.list(previous)
    assert items.data[0].content[0].text == "Say Four"
    # A turn sent to the other server as soon as a stream's last event is out (its record may
    # still be on its way to the database) continues it all the same.
    a.engine.say("<|channel|>final<|message|>Answer Five.<|return|>")
    with a.client().responses.stream(model=MODEL, input="Say Five", previous_response_id=previous) as stream:
        for event in stream:
            if event.type == "response.completed":
                five = event.response
                break
    six = b.client().responses.create(model=MODEL, input="Say Six", previous_response_id=five.id)
    assert six.status == "completed" and "Answer Five." in prompt_text(b.engine.calls[-1])


def test_a_background_stream_resumes_on_the_other_server(two_servers):
    a, b = two_servers
    a.engine.say(LONG)
    with contextlib.ExitStack() as streams:
        started = streams.enter_context(
            httpx.stream(
                "POST",
                f"{a.url}/v1/responses",
                json={"model": MODEL, "input": "tell me", "stream": True, "background": True},
                timeout=120,
            )
        )
        lines = started.iter_lines()
        seen = read_events(lines, 30)  # (the client's connection to server a then drops: it resumes on b)
        response_id = seen[0]["response"]["id"]
        assert b.client().responses.retrieve(response_id).status in ("queued", "in_progress")
        with httpx.stream(
            "GET",
            f"{b.url}/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": len(seen) - 1},
            timeout=120,
        ) as resumed:
            rest = events_of(resumed)
        whole = seen + [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    # On b, as a streams them: the events after the client's last one, in order, to the end.
    assert rest == whole[len(seen) :]
    assert rest[-1]["type"] == "response.completed"
    assert text_of(seen) + text_of(rest) == long_answer()
    # A replay from the start on b, now that it ended, is the whole stream too.
    with httpx.stream("GET", f"{b.url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=60) as r:
        assert events_of(r) == whole


def test_a_background_run_is_cancelled_from_the_other_server(two_servers):
    a, b = two_servers
    a.engine.say(LONG)
    started = a.client().responses.create(model=MODEL, input="tell me", background=True)
    wait_for(lambda: a.engine.calls and len(a.engine.calls[-1].generated) > 20)
    cancelled = b.client().responses.cancel(started.id)
    assert cancelled.status == "cancelled"  # (b waited for a to stop it and store it)
    assert a.engine.calls[-1].finish_reason == "abort"
    assert a.client().responses.retrieve(started.id).status == "cancelled"
    # Deleting a running response from the other server stops it too, for good.
    a.engine.say(LONG)
    second = a.client().responses.create(model=MODEL, input="and me", background=True)
    wait_for(lambda: len(a.engine.calls) == 2 and len(a.engine.calls[-1].generated) > 20)
    assert httpx.delete(f"{b.url}/v1/responses/{second.id}").status_code == 200
    wait_for(lambda: a.engine.calls[-1].finish_reason == "abort")
    wait_for(lambda: not a.state.runs.runs)
    for server in (a, b):
        assert httpx.get(f"{server.url}/v1/responses/{second.id}").status_code == 404


def test_a_run_whose_server_died_is_marked_failed_by_the_other(two_servers, postgres_url):
    a, b = two_servers
    dying, url = start_server(postgres_url)  # the scripted server, on the same database
    try:
        with contextlib.ExitStack() as streams:
            started = streams.enter_context(
                httpx.stream(
                    "POST",
                    f"{url}/v1/responses",
                    json={"model": MODEL, "input": "tell me", "stream": True, "background": True},
                    timeout=60,
                )
            )
            seen = read_events(started.iter_lines(), 30)
            response_id = seen[0]["response"]["id"]
            # b follows it, from the start, while it runs...
            follow = streams.enter_context(
                httpx.stream("GET", f"{b.url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=60)
            )
            following = follow.iter_lines()
            assert read_events(following, 30)[:30] == seen[:30]
            time.sleep(1.0)
            dying.send_signal(signal.SIGKILL)  # ... and its server dies
            dying.wait(timeout=30)
            rest = [json.loads(line[5:]) for line in following if line.startswith("data:")]
    finally:
        if dying.poll() is None:
            dying.kill()
    # Within its lease, b (or a) marked it failed, with what was stored: never lost, never
    # left in progress; b's stream ended with it.
    assert rest[-1]["type"] == "response.failed"
    stored = b.client().responses.retrieve(response_id)
    assert stored.status == "failed" and stored.error.code == "server_error"
    assert long_answer().startswith(stored.output[0].content[0].text) and stored.output[0].status == "incomplete"
    assert a.client().responses.retrieve(response_id).status == "failed"
    with httpx.stream("GET", f"{a.url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=60) as r:
        replayed = events_of(r)
    assert replayed[:30] == seen[:30] and replayed[-1]["type"] == "response.failed"
    assert [e["sequence_number"] for e in replayed] == list(range(len(replayed)))


def test_serve_takes_a_postgresql_url(postgres_url, tmp_path, monkeypatch, caplog):
    # (what it hands uvicorn, no server started: see serve_captured)
    monkeypatch.setenv("OSS_AGENT_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger="oss_agent")
    password_url = postgres_url.replace("postgres@", "postgres:s3cret@")  # (trust: any password)
    app = serve_captured(["--store", password_url])["app"]
    config = app.state.server.config
    assert config.store_url == password_url
    assert "s3cret" not in caplog.text and "postgres:***@" in caplog.text
    # What its startup opens (without loading the model): the PostgreSQL store.
    from agent_server.app import open_store
    from agent_server.store_postgres import PostgresStore

    async def opened():
        store = await open_store(config)
        await store.close()
        return store

    assert isinstance(asyncio.run(opened()), PostgresStore)
    # An unreachable database: startup fails, saying where (without the password).
    config.store_url = password_url.rsplit(":", 1)[0] + ":1/none"
    with pytest.raises(OSError):
        asyncio.run(opened())
    assert "could not open the store postgresql://postgres:***@127.0.0.1:1/none" in caplog.text


def test_following_a_run_on_the_other_server_speaks_the_requests_dialect(two_servers):
    """A run on a followed from b: on b's Open Responses prefix the spec's event names and the
    logprobs' bytes, on b's /v1 OpenAI's names and no bytes (as a's own stream would)."""
    from tests.agent_server.responses.test_dialect import SPEC, spec_problems

    a, b = two_servers
    thinking = "Think " * 300
    a.engine.say(
        f"<|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello there, friend.<|return|>"
    )
    body = {
        "model": MODEL,
        "input": "Hi",
        "background": True,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
    }
    response_id = httpx.post(f"{a.url}/v1/responses", json=body, timeout=60).json()["id"]
    with contextlib.ExitStack() as streams:
        spec_stream, openai_stream = (
            streams.enter_context(
                httpx.stream("GET", f"{b.url}{prefix}/responses/{response_id}", params={"stream": "true"}, timeout=60)
            )
            for prefix in (SPEC, "/v1")
        )
        assert a.state.runs.get(response_id) is not None  # (both follow it while a runs it)
        spec, openai = events_of(spec_stream), events_of(openai_stream)
    for stream in (spec, openai):
        assert stream[-1]["type"] == "response.completed"
        assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    assert [p for e in spec for p in spec_problems(e)] == []
    spec_kinds, openai_kinds = {e["type"] for e in spec}, {e["type"] for e in openai}
    assert "response.reasoning.delta" in spec_kinds and "response.reasoning_text.delta" not in spec_kinds
    assert "response.reasoning_text.delta" in openai_kinds and "response.reasoning.delta" not in openai_kinds
    for stream, with_bytes in ((spec, True), (openai, False)):
        logprobs = [lp for e in stream if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
        assert logprobs and all(("bytes" in lp) == with_bytes for lp in logprobs)


def test_a_response_whose_final_write_failed_is_marked_failed_by_its_live_server(tmp_path, postgres_url):
    """The server is alive, but the write of a run's final record failed: the record it wrote
    while the run ran (in progress) is marked failed by its own heartbeat, not left running."""
    engine = ScriptedEngine(token_delay=0.005)
    app = make_app(lambda: engine, tmp_path / "unused.sqlite3", store=shared_store(postgres_url))
    with LiveServer(app) as server:
        store = server.state.store
        put = store.put

        async def failing_put(record):  # (the final record, once the run ended)
            if record.status not in ("queued", "in_progress"):
                raise ConnectionError("the database went away")
            await put(record)

        store.put = failing_put
        server.engine.say("<|channel|>final<|message|>" + "word " * 100 + "<|return|>")
        response_id = httpx.post(
            f"{server.url}/v1/responses", json={"model": MODEL, "input": "tell me", "background": True}, timeout=60
        ).json()["id"]
        wait_for(lambda: server.state.runs.get(response_id) is None)
        assert httpx.get(f"{server.url}/v1/responses/{response_id}").json()["status"] == "in_progress"
        wait_for(lambda: httpx.get(f"{server.url}/v1/responses/{response_id}").json()["status"] == "failed")
        stored = httpx.get(f"{server.url}/v1/responses/{response_id}").json()
        assert stored["error"]["code"] == "server_error"
        store.put = put
