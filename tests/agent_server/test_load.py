"""Load test: 64 clients at once on the real engine (tiny random model, CPU, loopback HTTP).

Good streaming clients (Chat and Responses), clients that hang up mid-stream, and clients that
send bad requests all run together. Afterwards: every good stream was well formed and complete,
every bad request got an OpenAI-style 4xx, the engine holds no pages and no requests, the
server's per-request bookkeeping is empty, Python-side memory is back to its level after a
warm-up round, and every stored response (disconnected ones included) is in the store.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import sqlite3
import time
import tracemalloc
from collections import Counter

import httpx
import pytest

from agent_server.bench.serve import ServeTarget, send_request, sse_events
from agent_server.bench.server_metrics import parse_metrics
from agent_server.bench.workload import BenchRequest, random_prompt
from tests.conftest import MODEL, LiveServer, build_tiny_engine, make_app

pytestmark = pytest.mark.slow  # a long end-to-end run: CI runs it with `-m slow`

GOOD_TOKENS = 8  # output tokens of a good request: short, the test is about concurrency
# What a disconnecting client asks for: far more than it reads.
LONG_TOKENS = 200
# Python memory a round may leave behind for good (caches still filling: measured ~0.3 MiB);
# leaking the runs alone of one round's 26 responses measured 2.1 MiB.
MEMORY_TOLERANCE = 1 << 20


@pytest.fixture
def load_server(tmp_path, tiny_checkpoint):
    """A server of its own, so its pages, metrics and store see only this test's traffic."""
    engine = build_tiny_engine(tiny_checkpoint)
    app = make_app(lambda: engine, tmp_path / "responses.sqlite3")
    with LiveServer(app, kind="tiny") as server:
        yield server


# --- the clients ----------------------------------------------------------------------------


async def good_client(client: httpx.AsyncClient, url: str, api: str, prompt: str):
    """A streaming request read to the end; returns its result (bench_serve checks the stream)."""
    target = ServeTarget(
        base_url=url,
        model=MODEL,
        api=api,
        ignore_eos=api == "chat",
        timeout=120,
        extra_body={"store": True} if api == "responses" else {},
    )
    result = await send_request(client, target, BenchRequest(prompt, 0, GOOD_TOKENS))
    return api, result


async def disconnecting_client(client: httpx.AsyncClient, url: str, api: str, prompt: str, wait: float):
    """Starts a long stream, reads it until the first generated text, waits a little more (the
    model keeps generating), then hangs up. Returns the response id (Responses) or None."""
    if api == "chat":
        path, body = (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "stream": True,
                "max_tokens": LONG_TOKENS,
                "ignore_eos": True,
            },
        )
    else:
        path, body = (
            "/v1/responses",
            {"model": MODEL, "input": prompt, "stream": True, "max_output_tokens": LONG_TOKENS},
        )
    response_id = None
    async with client.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        async for data in sse_events(response):
            event = json.loads(data)
            if api == "responses":
                response_id = response_id or event["response"]["id"]  # response.created comes first
                if event["type"].endswith(".delta"):
                    break
            elif any(choice["delta"].get("content") for choice in event["choices"]):
                break
        else:
            raise AssertionError("the stream ended before it was cut")
        await asyncio.sleep(wait)  # generation goes on meanwhile; then the connection closes
    return response_id


def bad_requests(long_prompt: str) -> list[tuple[str, str, object, int]]:
    """(method, path, JSON body or raw bytes, expected status) of requests the server must refuse."""
    chat, responses = "/v1/chat/completions", "/v1/responses"
    user = [{"role": "user", "content": "hi"}]
    return [
        ("POST", chat, b"{not json", 400),
        ("POST", chat, {"messages": user, "stream": True}, 400),  # no model
        ("POST", chat, {"model": "no-such-model", "messages": user, "stream": True}, 404),
        ("POST", chat, {"model": MODEL, "messages": [], "stream": True}, 400),
        ("POST", chat, {"model": MODEL, "messages": user, "max_tokens": 0, "stream": True}, 400),
        ("POST", chat, {"model": MODEL, "messages": user, "temperature": "hot", "stream": True}, 400),
        ("POST", responses, {"model": MODEL, "input": long_prompt, "stream": True}, 400),  # over the context
        ("POST", responses, {"model": MODEL, "input": "hi", "previous_response_id": "resp_missing"}, 404),
        ("POST", responses, {"model": MODEL, "input": "hi", "max_output_tokens": -1, "stream": True}, 400),
        ("POST", responses, {"model": MODEL, "input": "hi", "background": True, "store": False}, 400),
        ("POST", responses, [1, 2, 3], 400),
        ("GET", "/v1/responses/resp_doesnotexist", None, 404),
    ]


async def bad_client(client: httpx.AsyncClient, url: str, method: str, path: str, body, expected: int):
    if isinstance(body, bytes):
        response = await client.request(method, url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = await client.request(method, url + path, json=body)
    return path, expected, response.status_code, response.json()


async def one_round(url: str, rng: random.Random, *, good: int, disconnects: int, bad: int):
    """All clients at once, in a shuffled order. Returns (good results, disconnected response
    ids, bad answers)."""
    long_prompt = random_prompt(rng, 1100)  # the test engine's context is 1024 tokens
    bad_list = (bad_requests(long_prompt) * 2)[:bad]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        jobs = []
        for i in range(good):
            prompt = random_prompt(rng, rng.randint(4, 48))
            jobs.append(("good", good_client(client, url, "chat" if i % 2 else "responses", prompt)))
        for i in range(disconnects):
            prompt = random_prompt(rng, rng.randint(4, 48))
            wait = rng.uniform(0.0, 0.3)
            jobs.append(("gone", disconnecting_client(client, url, "chat" if i % 2 else "responses", prompt, wait)))
        for method, path, body, expected in bad_list:
            jobs.append(("bad", bad_client(client, url, method, path, body, expected)))
        rng.shuffle(jobs)
        outcomes = await asyncio.gather(*(job for _, job in jobs))
    kinds = [kind for kind, _ in jobs]
    pick = lambda kind: [o for k, o in zip(kinds, outcomes) if k == kind]  # noqa: E731
    return pick("good"), [i for i in pick("gone") if i], pick("bad")


# --- the server's state -------------------------------------------------------------------


async def wait_until_idle(server: LiveServer, timeout: float = 30.0) -> None:
    """Until the engine has nothing running, waiting or parked and holds no page (aborts of
    disconnected streams reach it asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        stats, usage = server.engine.stats(), server.engine.cache_usage()
        busy = stats.running or stats.waiting or stats.parked or usage.full_pages_used or usage.sliding_pages_used
        if not busy and not server.state.runs.runs:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle: {stats}, {usage}, runs {list(server.state.runs.runs)}")
        await asyncio.sleep(0.05)


def python_memory() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


# Objects of these packages belong to requests while they run (runs, events, engine requests,
# sequences, asyncio tasks and queues, connections); none may outlive a round.
SERVER_PACKAGES = (
    "agent_server",
    "inference",
    "schemas",
    "openai",
    "starlette",
    "sse_starlette",
    "uvicorn",
    "h11",
    "asyncio",
    "anyio",
)


def live_objects() -> Counter[str]:
    """Live instances per class of the server's packages (the test's own results excluded)."""
    gc.collect()
    counts: Counter[str] = Counter()
    for obj in gc.get_objects():
        module = type(obj).__module__
        if (
            isinstance(module, str)
            and module.startswith(SERVER_PACKAGES)
            and not module.startswith("agent_server.bench.")
        ):
            counts[f"{module}.{type(obj).__qualname__}"] += 1
    return counts


async def leftover_objects(baseline: Counter[str], timeout: float = 5.0) -> dict[str, tuple[int, int]]:
    """Classes with more live instances than at the baseline (after letting closing connections
    finish for up to `timeout` seconds): {class: (before, now)}."""
    deadline = time.monotonic() + timeout
    while True:
        now = live_objects()
        grown = {name: (baseline[name], n) for name, n in now.items() if n > baseline[name]}
        if not grown or time.monotonic() > deadline:
            return grown
        await asyncio.sleep(0.1)


def stored_ids(server: LiveServer) -> set[str]:
    db = sqlite3.connect(str(server.state.config.store_path))
    try:
        return {row[0] for row in db.execute("SELECT id FROM responses")}
    finally:
        db.close()


def check_error_body(body: dict) -> None:
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]


async def check_good(client: httpx.AsyncClient, url: str, api: str, result) -> None:
    assert result.ok, result.error
    if api == "chat":
        # ignore_eos: exactly the tokens asked for; the usage chunk says so.
        assert result.output_counted_by == "usage" and result.output_tokens == GOOD_TOKENS
        assert result.finish_reason == "length"
        return
    assert result.response_id and 1 <= result.output_tokens <= GOOD_TOKENS
    stored = (await client.get(f"{url}/v1/responses/{result.response_id}")).json()
    assert stored["status"] == result.finish_reason in ("completed", "incomplete")
    assert stored["usage"]["output_tokens"] == result.output_tokens
    text = "".join(
        part.get("text", "")
        for item in stored["output"]
        if item["type"] in ("message", "reasoning")
        for part in item.get("content") or []
    )
    assert text == result.text  # what streamed is what was stored


# --- the test -------------------------------------------------------------------------------


async def test_64_concurrent_clients_with_disconnects_and_bad_requests(load_server, caplog):
    server, url, rng = load_server, load_server.url, random.Random(11)
    # The tiny model's noise is malformed Harmony, logged once per response: not kept in memory.
    caplog.set_level(logging.ERROR, logger="agent_server.agent.loop")
    tracemalloc.start()
    try:
        # Warm-up: the same mix, smaller, so caches and pools have their working size.
        warm_good, warm_gone, warm_bad = await one_round(url, rng, good=8, disconnects=4, bad=4)
        assert all(r.ok for _, r in warm_good), [r.error for _, r in warm_good if not r.ok]
        assert all(status == expected for _, expected, status, _ in warm_bad), warm_bad
        await wait_until_idle(server)
        objects_before, baseline = live_objects(), python_memory()
        metrics_before = parse_metrics(httpx.get(f"{url}/metrics").text)

        good, gone, bad = await one_round(url, rng, good=40, disconnects=12, bad=12)
        await wait_until_idle(server)
        leftovers = await leftover_objects(objects_before)
        grown = python_memory() - baseline
    finally:
        tracemalloc.stop()

    async with httpx.AsyncClient(timeout=30) as client:
        # Every good request completed with a well-formed stream.
        assert len(good) == 40
        for api, result in good:
            await check_good(client, url, api, result)
        # Every bad request got its 4xx with an OpenAI-style error body.
        assert len(bad) == 12
        for path, expected, status, body in bad:
            assert status == expected, (path, status, body)
            check_error_body(body)
        # Disconnected responses are stored, cut mid-stream (their pages were freed: see idle).
        assert len(gone) == 6
        for response_id in gone:
            stored = (await client.get(f"{url}/v1/responses/{response_id}")).json()
            assert stored["status"] == "cancelled", stored["status"]
            # (the turn grammar gives the random model a final channel early: text can come at once)
            assert 1 <= stored["usage"]["output_tokens"] < LONG_TOKENS

    # Nothing lost from the store, nothing extra: every stored response of both rounds.
    expected_ids = {r.response_id for _, r in warm_good + good if r.response_id} | set(warm_gone) | set(gone)
    assert stored_ids(server) == expected_ids

    # No 5xx, and the generation counter shows every disconnected stream was cut mid-stream.
    metrics_after = parse_metrics(httpx.get(f"{url}/metrics").text)
    delta = {key: metrics_after[key] - metrics_before.get(key, 0.0) for key in metrics_after}
    statuses = {
        dict(labels)["status"]: n for (name, labels), n in delta.items() if name == "oss_agent_requests_total" and n
    }
    assert not any(s.startswith("5") for s in statuses), statuses
    generated = delta[("oss_agent_generation_tokens_total", ())]
    good_tokens = sum(r.output_tokens for _, r in good)
    assert good_tokens + 12 <= generated < good_tokens + 12 * LONG_TOKENS

    # The server keeps no per-request state: no runs, no engine streams, no objects of any kind
    # beyond what it had before the round, and Python memory back to its level (a tolerance for
    # caches still filling).
    assert not server.state.runs.runs
    assert not server.engine._active and not server.engine._sinks
    assert not leftovers, f"objects left over after the round: {leftovers}"
    assert grown < MEMORY_TOLERANCE, f"Python memory grew by {grown / 2**20:.2f} MiB over a round"
