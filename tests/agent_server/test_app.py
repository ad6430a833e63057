"""Server plumbing: health and readiness, models, metrics, API keys, unknown routes, the CLI."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
import websockets

from agent_server.cli.main import build_parser
from tests.conftest import MODEL, LiveServer, make_app
from tests.fake_engine import ScriptedEngine


def metric(text: str, name: str, **labels) -> float:
    """The value of one Prometheus sample: 0 when the metric family is declared but this labelled
    sample has not been touched yet; a family missing altogether fails the test."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # exposition sorts labels
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else r"") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.M)
    if match:
        return float(match.group(1))
    family = re.sub(r"_(count|sum|bucket|created)$", "", name)
    declared = {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", text, re.M)}
    assert family in declared or family.removesuffix("_total") in declared, f"metric {name} is not exported"
    return 0.0


def test_health_ready_and_models(live_server):
    assert httpx.get(f"{live_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{live_server.url}/ready").json()["status"] == "ready"
    models = live_server.client().models.list()
    (card,) = models.data
    assert card.id == MODEL and card.object == "model"
    assert card.context_length == live_server.engine.max_model_len > 0
    assert live_server.client().models.retrieve(MODEL).id == MODEL


def test_metrics_move_as_requests_are_served(fake_server, fake_tools):
    engine, client = fake_server.engine, fake_server.client()
    before = httpx.get(f"{fake_server.url}/metrics").text
    engine.say(
        "<|channel|>analysis to=python code<|message|>print(1)<|call|>", "<|channel|>final<|message|>1<|return|>"
    )
    client.responses.create(model=MODEL, input="x", tools=[{"type": "code_interpreter", "container": "auto"}])
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    after = httpx.get(f"{fake_server.url}/metrics").text

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("oss_agent_requests_total", endpoint="/v1/responses", status="200") == 1
    assert grew("oss_agent_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert grew("oss_agent_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert grew("oss_agent_time_to_first_token_seconds_count") == 2  # one per response, not per turn
    generated = sum(len(c.generated) for c in engine.calls)
    assert grew("oss_agent_generation_tokens_total") == generated
    assert grew("oss_agent_prompt_tokens_total") == sum(len(c.request.prompt_token_ids) for c in engine.calls)
    assert grew("oss_agent_cached_prompt_tokens_total") == sum(c.num_cached_tokens for c in engine.calls) > 0
    assert grew("oss_agent_time_per_output_token_seconds_count") > 0
    assert grew("oss_agent_tool_calls_total", tool="python", outcome="ok") == 1
    assert grew("oss_agent_request_duration_seconds_count", endpoint="/v1/responses") == 1
    stats = engine.stats()
    assert metric(after, "oss_agent_prefix_cache_hit_ratio") == pytest.approx(
        stats.prefix_hit_tokens / stats.prefix_queries_tokens
    )
    assert "oss_agent_kv_cache_usage_ratio" in after


def test_streams_reach_the_engine_before_the_response_starts(tmp_path):
    """Chat and Responses streams hand the request to the engine before they send anything, so
    the engine prefills while the stream is being set up (docs/design.md §3's first token through HTTP)."""
    order: list[str] = []
    engine = ScriptedEngine()
    scripted_generate = engine.generate

    def generate(request):
        stream = scripted_generate(request)
        stream.on_open = lambda: order.append("engine")
        return stream

    engine.generate = generate
    app = make_app(lambda: engine, tmp_path / "responses.sqlite3")

    class Recorder:  # the app, noting when each response starts
        state = app.state

        async def __call__(self, scope, receive, send):
            async def recorded(message):
                if message["type"] == "http.response.start" and scope["path"].startswith("/v1/"):
                    order.append("response")
                await send(message)

            await app(scope, receive, recorded)

    bodies = {
        "chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        "responses": {"model": MODEL, "input": "hi", "stream": True},
    }
    with LiveServer(Recorder()) as server:
        for path, body in bodies.items():
            order.clear()
            with httpx.stream("POST", f"{server.url}/v1/{path}", json=body, timeout=60) as r:
                assert r.status_code == 200
                text = "".join(r.iter_text())
            assert '"OK' in text  # the scripted answer streamed
            assert order == ["engine", "response"], path


def test_api_key_protects_everything_but_health(tmp_path):
    app = make_app(ScriptedEngine, tmp_path / "r.db", api_key="s3cret")
    with LiveServer(app, api_key="s3cret") as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for path in ("/ready", "/metrics", "/v1/models"):
            r = httpx.get(f"{server.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert server.client().models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_routes_and_methods_get_json_errors(fake_server):
    r = httpx.get(f"{fake_server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.put(f"{fake_server.url}/v1/responses")
    assert r.status_code == 405 and "error" in r.json()


def test_model_endpoints_wait_for_the_engine(tmp_path):
    gate = asyncio.Event()

    async def slow_engine():
        await gate.wait()
        return ScriptedEngine()

    server = LiveServer(make_app(slow_engine, tmp_path / "r.db"))
    server.thread.start()
    try:
        while not server.server.started:
            pass
        url = f"http://127.0.0.1:{server.server.servers[0].sockets[0].getsockname()[1]}"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/ready").status_code == 503
        r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        assert "GET /ready answers 200 once it is loaded" in r.json()["error"]["message"]
        with pytest.raises(websockets.InvalidStatus) as info:  # the WebSocket of /v1/responses too
            with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).responses.connect():
                pass
        assert info.value.response.status_code == 503 and b"model_not_ready" in info.value.response.body
    finally:
        server.server.should_exit = True
        server.thread.join(timeout=30)


def test_cli_has_serve_and_generate():
    args = build_parser().parse_args(
        ["serve", "--port", "9000", "--tool-server", "demo", "--engine-option", "num_pages=64"]
    )
    assert args.command == "serve" and args.port == 9000 and args.tool_server == ["demo"]
    from agent_server.cli.serve import engine_options

    assert engine_options(args) == {"num_pages": 64}
    assert build_parser().parse_args(["generate", "hello"]).command == "generate"


def test_health_answers_while_the_model_loads_and_fails_when_it_cannot(tmp_path):
    # The engine is built on a worker thread: the event loop answers meanwhile.
    import threading

    from tests.fake_engine import ScriptedEngine

    release = threading.Event()

    def slow_factory():
        release.wait(20)
        return ScriptedEngine()

    server = LiveServer(make_app(slow_factory, tmp_path / "a.db"))
    server.thread.start()
    try:
        while not server.server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.server.servers[0].sockets[0].getsockname()[1]}"
        assert httpx.get(f"{url}/health", timeout=2).json() == {"status": "ok"}
        assert httpx.get(f"{url}/ready", timeout=2).json()["status"] == "loading"
        release.set()
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/ready", timeout=2).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        release.set()
        server.stop()

    # Stopped while it loads: the engine the thread goes on to build is shut down, not leaked.
    release.clear()
    built = []

    def factory_stopped_midway():
        release.wait(20)
        built.append(ScriptedEngine())
        return built[-1]

    midway = LiveServer(make_app(factory_stopped_midway, tmp_path / "c.db"))
    midway.thread.start()
    while not midway.server.started:
        time.sleep(0.01)
    midway.server.should_exit = True
    time.sleep(0.3)
    assert midway.thread.is_alive()  # waiting for the load to end
    release.set()
    midway.thread.join(timeout=20)
    assert not midway.thread.is_alive() and built and built[0].shut_down

    def broken_factory():
        raise RuntimeError("no such model")

    broken = LiveServer(make_app(broken_factory, tmp_path / "b.db"))
    try:
        with pytest.raises(RuntimeError, match="failed to start"):
            broken.start()
        health = httpx.get(f"{broken.url}/health", timeout=2)  # a liveness probe restarts it
        assert health.status_code == 503 and "no such model" in health.json()["error"]
    finally:
        broken.stop()
