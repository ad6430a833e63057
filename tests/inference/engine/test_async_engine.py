"""AsyncEngine (the engine on its own thread) and EngineProcess (in a process of its own): the
same contract for both, streaming to asyncio consumers. What only a process does (die, fail to
start) is in tests/inference/engine/test_process.py."""

from __future__ import annotations

import asyncio

import pytest

from inference.config import EngineConfig
from inference.engine.async_engine import AsyncEngine
from inference.engine.core import LLMEngine
from inference.engine.process import EngineProcess, EngineSpec
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from inference.request import GenerationRequest, SamplingParams
from inference.runner.single_sequence import generate
from tests.engine_runs import collect
from tests.engine_runs import greedy_request as greedy
from tests.engine_runs import random_prompt as prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-async"), seed=1)


@pytest.fixture(scope="module")
def model(checkpoint):
    return GptOssModel.from_pretrained(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def engine_process(checkpoint):
    """One engine process for the module (each test leaves it idle)."""
    eng = EngineProcess(
        EngineSpec(model_dir=str(checkpoint), options={"device": "cpu", "page_size": 4, "num_pages": 128})
    )
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture
async def thread_engine(model):
    eng = AsyncEngine(LLMEngine(model, EngineConfig(page_size=4, num_pages=128)))
    yield eng
    await eng.shutdown()


@pytest.fixture(params=["thread", "process"])
def engine(request):
    return request.getfixturevalue("thread_engine" if request.param == "thread" else "engine_process")


async def test_concurrent_streams_match_alone_and_never_block_the_loop(engine, model):
    prompts = [prompt(i, 6 + 5 * i) for i in range(4)]
    expected = [generate(model, p, 8) for p in prompts]
    decoded_before = engine.stats().tokens_decoded
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            await asyncio.sleep(0.002)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    results = await asyncio.gather(*(collect(engine.generate(greedy(str(i), p, 8))) for i, p in enumerate(prompts)))
    done.set()
    await tick_task
    for deltas, want, p in zip(results, expected, prompts):
        assert [t for d in deltas for t in d.token_ids] == want
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[0].num_prompt_tokens == len(p)
    # The model ran on another thread or process: the event loop kept ticking throughout (~30 steps).
    assert ticks >= 20
    await engine.wait_idle()
    stats = engine.stats()
    assert stats.tokens_decoded - decoded_before == 32
    assert stats.running == stats.waiting == 0 and stats.pages_used == 0


async def test_bad_request_raises_before_streaming(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(GenerationRequest("x", [1, 2], SamplingParams(top_p=0)))
    with pytest.raises(ValueError, match="context length"):
        engine.generate(greedy("y", [1, 2], engine.max_model_len))
    stream = engine.generate(greedy("dup", [1, 2, 3], 2))
    first = await stream.__anext__()
    with pytest.raises(ValueError, match="already running"):
        engine.generate(greedy("dup", [1, 2, 3], 2))
    assert len([first, *await collect(stream)]) == 2
    # A stream that is never iterated submits nothing and holds its id for no one.
    engine.generate(greedy("unused", [1, 2, 3], 2))
    assert len(await collect(engine.generate(greedy("unused", [1, 2, 3], 2)))) == 2


async def test_open_sends_the_request_before_the_first_read(engine):
    """A server opens the stream as soon as the prompt is ready, so the engine prefills while the
    response is set up: the engine works on an opened request nobody reads yet, the stream then
    reads every delta, and a stream opened and dropped unread is aborted."""
    decoded_before = engine.stats().tokens_decoded
    stream = engine.generate(greedy("early", prompt(12, 6), 5))
    stream.open()
    stream.open()  # idempotent
    with pytest.raises(ValueError, match="already running"):
        engine.generate(greedy("early", [1, 2, 3], 2))
    await engine.wait_idle()  # finished without a single read
    assert engine.stats().tokens_decoded - decoded_before == 5
    deltas = await collect(stream)
    assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].finish_reason == "length"

    dropped = engine.generate(greedy("dropped", prompt(13, 6), 400))
    dropped.open()
    del dropped  # a response that never started streaming
    await engine.wait_idle()
    assert engine.stats().running == 0 and engine.stats().pages_used == 0
    assert engine.stats().tokens_decoded - decoded_before < 5 + 400
    assert len(await collect(engine.generate(greedy("dropped", [1, 2, 3], 2)))) == 2  # its id is free


async def test_abort_ends_the_stream_and_frees_pages(engine):
    stream = engine.generate(greedy("long", prompt(10, 9), 200))
    seen = []
    async for delta in stream:
        seen.append(delta)
        if len(seen) == 2:
            assert engine.stats().pages_used > 0
            engine.abort("long")
    assert seen[-1].finish_reason == "abort" and len(seen) < 200
    await engine.wait_idle()
    assert engine.stats().pages_used == 0 and engine.stats().running == 0


async def test_leaving_the_stream_early_aborts(engine):
    decoded_before = engine.stats().tokens_decoded
    stream = engine.generate(greedy("gone", prompt(11, 9), 200))
    async for _ in stream:
        break
    await stream.aclose()  # what a disconnected client's cancelled task does
    await engine.wait_idle()
    assert engine.stats().running == 0 and engine.stats().pages_used == 0
    assert engine.stats().tokens_decoded - decoded_before < 200


async def test_an_id_left_early_is_taken_until_its_abort_lands(engine, model):
    # Deltas go by request id: a new request with the id of one still being aborted would get
    # the old one's abort, then run with nobody reading it.
    stream = engine.generate(greedy("same-id", prompt(15, 9), 200))
    await stream.__anext__()
    await stream.aclose()
    with pytest.raises(ValueError, match="already running"):
        engine.generate(greedy("same-id", [1], 1))
    again = None
    for _ in range(500):  # the abort's last delta frees the id
        await asyncio.sleep(0.01)
        try:
            again = engine.generate(greedy("same-id", prompt(16, 7), 6))
            break
        except ValueError:
            pass
    assert again is not None
    deltas = await asyncio.wait_for(collect(again), 30)
    assert deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == generate(model, prompt(16, 7), 6)
    await engine.wait_idle()
    assert engine.stats().running == 0 and engine.stats().pages_used == 0
    # A stream that had its last delta before it was left frees the id at once.
    done = engine.generate(greedy("finished", prompt(17, 5), 2))
    await done.__anext__()
    await engine.wait_idle()
    await asyncio.sleep(0.05)  # (the last delta reaches the queue)
    await done.aclose()
    engine.generate(greedy("finished", [1], 1))


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


async def test_shutdown_aborts_running_requests(model):
    eng = AsyncEngine(LLMEngine(model, EngineConfig(page_size=4, num_pages=64)))
    stream = eng.generate(greedy("s", prompt(14, 5), 200))
    first = await stream.__anext__()
    await eng.shutdown()
    rest = [d async for d in stream]
    assert first.token_ids and rest[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError):
        eng.generate(greedy("after", [1], 1))


async def test_a_stream_first_read_after_shutdown_ends(model):
    eng = AsyncEngine(LLMEngine(model, EngineConfig(page_size=4, num_pages=64)))
    stream = eng.generate(greedy("late", prompt(18, 5), 4))  # validated, not sent yet
    await eng.shutdown()
    deltas = await asyncio.wait_for(collect(stream), 5)
    assert deltas[-1].finish_reason == "abort"


async def test_from_pretrained(checkpoint):
    eng = AsyncEngine.from_pretrained(
        str(checkpoint), device="cpu", num_pages=32, page_size=8, dtype="float32", max_model_len=128
    )
    try:
        assert eng.max_model_len == 128 and eng.vocab_size == 201088 and eng.model_name == checkpoint.name
        deltas = await collect(eng.generate(greedy("a", prompt(15, 4), 3)))
        assert sum(len(d.token_ids) for d in deltas) == 3
        assert eng.stats().pages_total == 32
    finally:
        await eng.shutdown()
    with pytest.raises(TypeError, match="unknown engine options"):
        AsyncEngine.from_pretrained(str(checkpoint), device="cpu", num_pagez=3)


async def test_a_failing_step_fails_its_request_and_the_engine_keeps_serving(thread_engine, model, monkeypatch):
    engine = thread_engine
    real_run = engine.engine.runner.run
    failures = []

    def fail_once(batch):
        if not failures:
            failures.append(batch)
            raise RuntimeError("kernel crashed")
        return real_run(batch)

    monkeypatch.setattr(engine.engine.runner, "run", fail_once)
    broken = await collect(engine.generate(greedy("bad", prompt(16, 5), 4)))
    assert broken[-1].finish_reason == "error" and "kernel crashed" in broken[-1].error
    ids = prompt(17, 5)
    fine = await collect(engine.generate(greedy("good", ids, 4)))
    assert [t for d in fine for t in d.token_ids] == generate(model, ids, 4)
    await engine.wait_idle()
    assert engine.stats().pages_used == 0


async def test_a_scheduler_bug_ends_streams_with_error_and_the_thread_survives(thread_engine, model, monkeypatch):
    engine = thread_engine
    real_schedule = engine.engine.scheduler.schedule
    calls = []

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise AssertionError("bookkeeping bug")
        return real_schedule()

    monkeypatch.setattr(engine.engine.scheduler, "schedule", broken_once)
    broken = await collect(engine.generate(greedy("bug", prompt(18, 5), 4)))
    assert broken[-1].finish_reason == "error" and "bookkeeping bug" in broken[-1].error
    ids = prompt(19, 5)
    fine = await collect(engine.generate(greedy("after-bug", ids, 3)))
    assert [t for d in fine for t in d.token_ids] == generate(model, ids, 3)
