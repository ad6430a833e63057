"""EngineProcess: what only an engine in a process of its own does. It may fail to start, die
(its streams then fail instead of hanging, and the server says so), and shut down.

The contract it shares with `AsyncEngine` (greedy tokens equal the reference, bad requests raise
before streaming, aborts free pages, parked sequences continue) is tested on both in
tests/inference/engine/test_async_engine.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from inference.engine.process import EngineProcess, EngineSpec
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from tests.engine_runs import collect
from tests.engine_runs import greedy_request as greedy
from tests.engine_runs import random_prompt as prompt

OPTIONS = {"device": "cpu", "page_size": 4, "num_pages": 128}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-process"), seed=1)


@pytest.mark.slow
async def test_shutdown_aborts_running_requests(checkpoint):
    eng = EngineProcess(EngineSpec(model_dir=str(checkpoint), options=OPTIONS))
    assert eng.pid != os.getpid() and eng.vocab_size == 201088 and eng.failure is None
    stream = eng.generate(greedy("s", prompt(14, 5), 400))
    first = await stream.__anext__()
    await eng.shutdown()
    rest = [d async for d in stream]
    assert first.token_ids and rest[-1].finish_reason == "abort"
    assert eng._process.exitcode == 0
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(greedy("after", [1], 1))


@pytest.mark.slow
async def test_a_dead_engine_process_fails_its_streams_and_refuses_new_ones(checkpoint):
    eng = EngineProcess(EngineSpec(model_dir=str(checkpoint), options=OPTIONS))
    stream = eng.generate(greedy("k", prompt(15, 5), 400))
    first = await stream.__anext__()
    os.kill(eng.pid, signal.SIGKILL)
    rest = await asyncio.wait_for(collect(stream), 30)
    assert first.token_ids and rest[-1].finish_reason == "error"
    assert "engine process exited" in rest[-1].error and str(-signal.SIGKILL) in rest[-1].error
    await asyncio.wait_for(eng.wait_idle(), 30)
    with pytest.raises(RuntimeError, match="exited"):
        eng.generate(greedy("after", [1], 1))
    await eng.shutdown()


@pytest.mark.slow
def test_a_spec_that_cannot_build_raises_with_the_engine_process_traceback(tmp_path):
    with pytest.raises(RuntimeError, match="could not build its engine") as info:
        EngineProcess(EngineSpec(model_dir=str(tmp_path / "missing"), options={"device": "cpu"}))
    assert "Traceback" in str(info.value)
    with pytest.raises(RuntimeError, match="unknown engine options"):
        EngineProcess(EngineSpec(model_dir=str(tmp_path), options={"device": "cpu", "num_pagez": 3}))
    with pytest.raises(ValueError, match="model_dir or a random_config"):
        EngineSpec().build()


@pytest.mark.slow
def test_the_server_reports_a_dead_engine_process(tmp_path, checkpoint):
    """/health and /ready turn 503 with the reason, Chat answers 503 engine_unavailable, a
    Responses request ends as a failed response: the server stays up to say so."""
    import httpx

    from tests.conftest import MODEL, LiveServer, make_app

    engine = EngineProcess(EngineSpec(model_dir=str(checkpoint), options=OPTIONS))
    with LiveServer(make_app(lambda: engine, tmp_path / "responses.sqlite3")) as server:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30  # the signal, then the server's loop reading the pipe's end
        while httpx.get(f"{server.url}/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        for path in ("/health", "/ready"):
            r = httpx.get(f"{server.url}{path}")
            assert r.status_code == 503 and r.json()["status"] == "failed" and "exited" in r.json()["error"]
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        # A stream is refused before it starts: the request reaches the engine before the response.
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        r = httpx.post(
            f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3}, timeout=60
        )
        assert r.status_code == 200 and r.json()["status"] == "failed" and r.json()["error"]["code"] == "server_error"


@pytest.mark.slow
async def test_a_busy_event_loop_sending_long_prompts_does_not_deadlock_with_the_engine(checkpoint):
    """The engine process sends its events while the server's loop is busy (the events pipe
    fills and the engine process waits on it), and the loop then sends more than the command
    pipe holds (long prompts): the engine process must still read them, or the loop waits in
    `send` forever and never reads the events the engine process waits to send."""
    import threading

    from inference.request import GenerationRequest, SamplingParams

    options = {
        "device": "cpu",
        "page_size": 16,
        "num_pages": 1024,
        "max_model_len": 8192,
        "max_num_batched_tokens": 256,
    }
    eng = EngineProcess(EngineSpec(model_dir=str(checkpoint), options=options))
    chatty = [
        eng.generate(
            GenerationRequest(f"c{i}", prompt(i, 4), SamplingParams(temperature=0, max_tokens=4000, logprobs=20))
        )
        for i in range(32)
    ]
    for stream in chatty:
        stream.open()
    await asyncio.sleep(0.5)
    time.sleep(3)  # the loop is busy (rendering, parsing): it reads no events meanwhile
    killed = threading.Event()

    def watchdog():  # a deadlock never ends by itself: kill the engine process to get the loop back
        if not done.wait(30):
            killed.set()
            os.kill(eng.pid, signal.SIGKILL)

    done = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    long = [eng.generate(greedy(f"long{i}", prompt(100 + i, 8000), 1)) for i in range(40)]  # about 1.6 MB
    for stream in long:
        stream.open()
    done.set()
    assert not killed.is_set(), "the event loop waited in send() on a full command pipe"
    await eng.shutdown()
    assert eng._process.exitcode == 0
