"""Shared fixtures: live servers (uvicorn on a loopback port) over a scripted or a real engine.

`fake_server` runs the app on `ScriptedEngine` with fake browser / python / MCP tool servers;
`tiny_engine_server` runs it on the real `inference.engine.async_engine.AsyncEngine` over a tiny random
checkpoint (skipped while that engine cannot be built), `tiny_process_server` on the same engine
in a process of its own (`inference.engine.process.EngineProcess`); `live_server` is parametrized
over all three for tests whose assertions hold for any model.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` (or `gpu(count=N)`): the test needs N CUDA GPUs (default 1); without
    them it is skipped. The GPU suite selects these with `-m gpu` (benchmarks/gpu_suite.sh)."""
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            needed = marker.kwargs.get("count", 1)
            if available < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}"))


MODEL = "gpt-oss-test"
# The real engine on the tiny checkpoint: float32 on CPU, its context as the load tests need.
TINY_ENGINE_OPTIONS = dict(device="cpu", max_model_len=1024, num_pages=256, enforce_eager=True)


class LiveServer:
    """An ASGI app served by uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app, *, kind: str = "fake", api_key: str | None = None, limits=None):
        import uvicorn

        from agent_server.http_limits import HttpLimits, uvicorn_options

        self.app = app
        self.kind = kind
        self.api_key = api_key
        # The connection limits `oss-agent serve` runs with (`limits`: other values).
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=0,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=5,
                **uvicorn_options(limits or HttpLimits()),
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    @property
    def state(self):
        return self.app.state.server

    @property
    def engine(self):
        return self.state.engine

    def start(self, ready_timeout: float = 300) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + ready_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while True:
            r = httpx.get(f"{self.url}/ready", headers=headers)
            if r.status_code == 200:
                return self
            if r.json().get("status") == "failed":
                raise RuntimeError(f"server failed to start: {r.json()}")
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready in time")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120, **kwargs
        )

    def __enter__(self) -> "LiveServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_for(predicate, timeout: float = 20.0) -> None:
    """Poll `predicate` until it holds (an assertion error after `timeout` seconds): for what a
    server does after its reply, such as an engine request's abort landing."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def serve_captured(argv: list[str]) -> dict:
    """Run `oss-agent serve ARGV` up to the point of serving: what it would hand uvicorn (the
    app and the server settings), with no server started and so no model loaded."""
    import logging

    import uvicorn

    from agent_server.cli.main import build_parser
    from agent_server.cli.serve import run

    captured: dict = {}

    class CapturedServer:
        def __init__(self, config):
            captured.update(
                app=config.app,
                timeout_graceful_shutdown=config.timeout_graceful_shutdown,
                access_log=config.access_log,
                port=config.port,
                http=config.http,
                timeout_keep_alive=config.timeout_keep_alive,
            )
            self.should_exit = False

        def run(self):
            pass

    root = logging.getLogger()
    filters = {h: list(h.filters) for h in root.handlers}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(uvicorn, "Server", CapturedServer)
            assert run(build_parser().parse_args(["serve", *argv])) == 0
        captured["log_filters"] = [f for h in root.handlers for f in h.filters]
    finally:
        for handler, kept in filters.items():  # (run adds its request-id filter to the root's handlers)
            handler.filters[:] = kept
    return captured


def make_app(engine_factory, store_path: Path, *, tools=None, api_key: str | None = None, store=None, **config):
    """`store`: the store it opens at startup, a factory (a coroutine function) of one, e.g. a
    `PostgresStore.open` with the test's settings; by default, SQLite at `store_path` (or the
    PostgreSQL database of a `store_url` in `config`)."""
    from agent_server.app import create_app
    from agent_server.state import ServerConfig

    async def tool_servers():
        return list(tools or [])

    cfg = ServerConfig(model_name=MODEL, store_path=store_path, api_key=api_key, **config)
    return create_app(cfg, engine_factory, tool_servers=tool_servers, store=store)


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server for the session (tests/postgres.py); skips without
    PostgreSQL, fails under CI."""
    from tests.postgres import start_postgres

    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """The URL of a new empty database on the throwaway server."""
    return postgres_server.create_database()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def store_backend(request) -> str:
    """Each store backend in turn: "sqlite" or "postgres" (a server of its own: with the slow tests)."""
    return request.param


@pytest.fixture
def store_url(request, store_backend) -> str | None:
    """For `make_app(..., store_url=store_url)`: None (SQLite at the store path) or the URL of a
    new PostgreSQL database, per `store_backend`."""
    return request.getfixturevalue("postgres_url") if store_backend == "postgres" else None


def shared_store(url: str, heartbeat: float = 0.5, lease: float = 4.0):
    """`make_app(store=...)`: a PostgreSQL store on `url` whose servers' leases are short, so
    that a test sees a dead server's runs failed within seconds (long enough for a loaded CPU)."""

    async def open_store():
        from agent_server.store_postgres import PostgresStore

        return await PostgresStore.open(url, heartbeat=heartbeat, lease=lease)

    return open_store


@pytest.fixture
def fake_tools():
    from tests.fake_tools import FakeBrowser, FakeMcp, FakePython

    return {"browser": FakeBrowser(), "python": FakePython(), "mcp": FakeMcp()}


@pytest.fixture
def fake_engine():
    from tests.fake_engine import ScriptedEngine

    return ScriptedEngine()


@pytest.fixture
def fake_server(tmp_path, fake_engine, fake_tools):
    app = make_app(lambda: fake_engine, tmp_path / "responses.sqlite3", tools=fake_tools.values())
    with LiveServer(app, kind="fake") as server:
        yield server


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from inference.model.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gpt-oss"), seed=0)


def build_tiny_engine(checkpoint: Path):
    """The real engine on the tiny checkpoint, float32 on CPU; skips while it cannot be built."""
    try:
        from inference.engine.async_engine import AsyncEngine
    except ImportError as e:
        pytest.skip(f"inference.engine.core is not available: {e}")
    try:
        return AsyncEngine.from_pretrained(str(checkpoint), **TINY_ENGINE_OPTIONS)
    except ImportError as e:  # a module the engine needs is still being written
        pytest.skip(f"the real engine cannot be built yet: {e}")


@pytest.fixture(scope="session")
def tiny_engine_server(tmp_path_factory, tiny_checkpoint):
    engine = build_tiny_engine(tiny_checkpoint)
    app = make_app(lambda: engine, tmp_path_factory.mktemp("tiny-store") / "responses.sqlite3")
    with LiveServer(app, kind="tiny") as server:
        yield server


@pytest.fixture(scope="session")
def tiny_process_server(tmp_path_factory, tiny_checkpoint):
    """`tiny_engine_server`'s engine in a process of its own (`EngineProcess`, what `oss-agent
    serve` runs on CUDA): the same tests hold."""
    from inference.engine.process import EngineProcess, EngineSpec

    engine = EngineProcess(EngineSpec(model_dir=str(tiny_checkpoint), options=TINY_ENGINE_OPTIONS))
    app = make_app(lambda: engine, tmp_path_factory.mktemp("tiny-process-store") / "responses.sqlite3")
    with LiveServer(app, kind="tiny") as server:
        yield server


@pytest.fixture(params=["fake", "tiny"])
def tool_server(request, tmp_path, fake_tools, tiny_checkpoint):
    """A server with the fake tool servers whose engine says what the test scripts: the
    `ScriptedEngine`, or the real engine teacher-forced through the same script."""
    if request.param == "fake":
        return request.getfixturevalue("fake_server")
    from tests.fake_engine import TeacherForcedEngine

    engine = TeacherForcedEngine(build_tiny_engine(tiny_checkpoint))
    server = LiveServer(
        make_app(lambda: engine, tmp_path / "responses.sqlite3", tools=fake_tools.values()), kind="tiny"
    ).start()
    request.addfinalizer(server.stop)
    return server


@pytest.fixture(params=["fake", "tiny", "tiny-process"])
def live_server(request):
    """A running server on the scripted engine, the real one, or the real one in a process of its
    own; tests read `live_server.kind` ("fake" or "tiny") to script the fake."""
    return request.getfixturevalue(
        {"fake": "fake_server", "tiny": "tiny_engine_server", "tiny-process": "tiny_process_server"}[request.param]
    )


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_section(title: str) -> str:
    """The text of README.md's `## title` section (up to the next `## ` heading)."""
    text = README.read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """The server a new user starts: `oss-agent serve` exactly as README.md's set-up section runs
    it (no --model: the tiny random-weight model), with its cache (checkpoint, store) in a
    temporary folder instead of ~/.cache/oss-agent."""
    import re
    import shlex

    command = re.search(r"oss-agent serve([^\n&|;]*)", readme_section("Set up")).group(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OSS_AGENT_CACHE", str(tmp_path_factory.mktemp("oss-agent-cache")))
        app = serve_captured(shlex.split(command))["app"]
        with LiveServer(app, kind="default") as server:
            yield server
