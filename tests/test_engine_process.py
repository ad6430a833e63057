"""EngineProcess: the engine in a child process, streaming to asyncio consumers in this one.

The same contract as `AsyncEngine` (tests/test_engine_async.py): greedy tokens equal the
single-sequence reference, bad requests raise before streaming, aborts and early exits free the
pages, parked sequences continue and release. Then what only a process can do: die, and fail its
streams instead of hanging them.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from inference.engine_process import EngineProcess, EngineSpec
from inference.model import GptOssModel
from inference.request import GenerationRequest, SamplingParams
from inference.single_sequence import generate
from inference.tiny_checkpoint import write_tiny_checkpoint

OPTIONS = {"device": "cpu", "page_size": 4, "num_pages": 128}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-process"), seed=1)


@pytest.fixture(scope="module")
def model(checkpoint):
    return GptOssModel.from_pretrained(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def engine(checkpoint):
    """One engine process for the module's contract tests (each test leaves it idle)."""
    eng = EngineProcess(EngineSpec(model_dir=str(checkpoint), options=OPTIONS))
    yield eng
    asyncio.run(eng.shutdown())


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(length)]


def greedy(rid: str, ids: list[int], max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens), **kw)


async def collect(stream) -> list:
    return [delta async for delta in stream]


async def test_concurrent_streams_match_the_reference(engine, model, checkpoint):
    assert engine.model_name == checkpoint.name and engine.vocab_size == 201088 and engine.pid != os.getpid()
    prompts = [prompt(i, 6 + 5 * i) for i in range(4)]
    expected = [generate(model, p, 8) for p in prompts]
    decoded_before = engine.stats().tokens_decoded
    results = await asyncio.gather(*(collect(engine.generate(greedy(f"c{i}", p, 8))) for i, p in enumerate(prompts)))
    for deltas, want, p in zip(results, expected, prompts):
        assert [t for d in deltas for t in d.token_ids] == want
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[0].num_prompt_tokens == len(p)
    await engine.wait_idle()
    stats = engine.stats()
    assert stats.tokens_decoded - decoded_before == 32 and stats.running == stats.waiting == 0
    assert stats.pages_used == 0 and engine.cache_usage().full_pages_used == 0


async def test_bad_request_raises_before_streaming(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(GenerationRequest("x", [1, 2], SamplingParams(top_p=0)))
    with pytest.raises(ValueError, match="context length"):
        engine.generate(greedy("y", [1, 2], engine.max_model_len))
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.generate(greedy("z", [1, engine.vocab_size], 2))
    stream = engine.generate(greedy("dup", [1, 2, 3], 2))
    first = await stream.__anext__()
    with pytest.raises(ValueError, match="already running"):
        engine.generate(greedy("dup", [1, 2, 3], 2))
    assert len([first, *await collect(stream)]) == 2
    # A stream that is never iterated sends nothing and holds its id for no one.
    engine.generate(greedy("unused", [1, 2, 3], 2))
    assert len(await collect(engine.generate(greedy("unused", [1, 2, 3], 2)))) == 2
    await engine.wait_idle()


async def test_abort_and_leaving_early_free_the_pages(engine):
    seen = []
    async for delta in engine.generate(greedy("long", prompt(10, 9), 200)):
        seen.append(delta)
        if len(seen) == 2:
            engine.abort("long")
    assert seen[-1].finish_reason == "abort" and len(seen) < 200
    stream = engine.generate(greedy("gone", prompt(11, 9), 200))
    async for _ in stream:
        break
    await stream.aclose()  # what a disconnected client's cancelled task does
    await engine.wait_idle()
    assert engine.stats().running == 0 and engine.stats().pages_used == 0


async def test_keep_alive_then_continue_then_release(engine, model):
    first = prompt(12, 10)
    out0 = await collect(engine.generate(greedy("t0", first, 4, keep_alive=True)))
    generated = [t for d in out0 for t in d.token_ids]
    await engine.wait_idle()
    assert engine.stats().parked == 1 and engine.stats().pages_used > 0
    second = first + generated + prompt(13, 3)
    out1 = await collect(engine.generate(greedy("t1", second, 4, keep_alive=True, continue_from="t0")))
    assert out1[0].num_cached_tokens == len(first) + len(generated) - 1
    assert [t for d in out1 for t in d.token_ids] == generate(model, second, 4)
    engine.release("t1")
    await engine.wait_idle()
    assert engine.stats().parked == 0 and engine.stats().pages_used == 0


async def test_shutdown_aborts_running_requests(checkpoint):
    eng = EngineProcess(EngineSpec(model_dir=str(checkpoint), options=OPTIONS))
    stream = eng.generate(greedy("s", prompt(14, 5), 400))
    first = await stream.__anext__()
    await eng.shutdown()
    rest = [d async for d in stream]
    assert first.token_ids and rest[-1].finish_reason == "abort"
    assert eng._process.exitcode == 0
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(greedy("after", [1], 1))


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


def test_a_spec_that_cannot_build_raises_with_the_engine_process_traceback(tmp_path):
    with pytest.raises(RuntimeError, match="could not build its engine") as info:
        EngineProcess(EngineSpec(model_dir=str(tmp_path / "missing"), options={"device": "cpu"}))
    assert "Traceback" in str(info.value)
    with pytest.raises(RuntimeError, match="unknown engine options"):
        EngineProcess(EngineSpec(model_dir=str(tmp_path), options={"device": "cpu", "num_pagez": 3}))
    with pytest.raises(ValueError, match="model_dir or a random_config"):
        EngineSpec().build()


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
        r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "failed" and r.json()["error"]["code"] == "server_error"
