"""`/metrics` KV-cache usage on the real engine: the gauge rises while a request holds pages and
falls back to zero when they are freed.

A Responses request with a code-interpreter call parks its first turn on the engine (its KV
pages kept for the continuation) while the tool runs. The tool here waits for the test, so the
scrape happens at a moment when a known sequence holds a known number of pages.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading

import httpx
import pytest
from openai_harmony import ToolNamespaceConfig

from tests.agent_server.responses.test_routes import PYTHON
from tests.conftest import MODEL, LiveServer, build_tiny_engine, make_app, wait_for
from tests.fake_engine import TeacherForcedEngine
from tools.protocol import ToolResult

GAUGE = "oss_agent_kv_cache_usage_ratio"


class GatedPythonSession:
    def __init__(self, server: "GatedPython"):
        self.server = server

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        self.server.entered.set()
        while not self.server.gate.is_set():  # poll: the event loop keeps serving /metrics meanwhile
            await asyncio.sleep(0.01)
        return ToolResult("42\n")

    def resolve_citations(self, text: str):
        return text, []

    async def close(self) -> None:
        pass


class GatedPython:
    """A python tool server whose calls wait until the test opens `gate`."""

    name = "python"
    kind = "python"

    def __init__(self):
        self.entered = threading.Event()
        self.gate = threading.Event()

    def harmony_namespace(self) -> ToolNamespaceConfig:
        return ToolNamespaceConfig.python()

    def open_session(self) -> GatedPythonSession:
        return GatedPythonSession(self)

    async def aclose(self) -> None:
        pass


def scrape(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} is not exported"
    return float(match.group(1))


def test_kv_usage_gauge_follows_the_pages_a_request_holds(tmp_path, tiny_checkpoint):
    engine = TeacherForcedEngine(build_tiny_engine(tiny_checkpoint))
    page_size = engine.engine.engine.page_size
    tool = GatedPython()
    app = make_app(lambda: engine, tmp_path / "r.db", tools=[tool])
    with LiveServer(app, kind="tiny") as server:
        assert scrape(server.url, GAUGE) == 0.0
        engine.say(PYTHON, "<|channel|>final<|message|>42.<|return|>")
        result = {}

        def ask():
            result["response"] = server.client().responses.create(
                model=MODEL, input="6*7?", tools=[{"type": "code_interpreter", "container": {"type": "auto"}}]
            )

        thread = threading.Thread(target=ask)
        thread.start()
        try:
            assert tool.entered.wait(30), "the tool was never called"
            wait_for(lambda: engine.stats().parked == 1)
            held = scrape(server.url, GAUGE)
            stats = engine.stats()
            (first,) = engine.calls
            # The parked sequence: its prompt and generated tokens, all but the last computed.
            computed = len(first.request.prompt_token_ids) + len(first.generated) - 1
            assert stats.running == 0 and stats.pages_total == 256
            assert math.ceil(computed / page_size) <= stats.pages_used <= math.ceil(computed / page_size) + 1
            assert held == pytest.approx(stats.pages_used / stats.pages_total) and held > 0
        finally:
            tool.gate.set()
            thread.join(60)
        assert result["response"].status == "completed" and result["response"].output_text == "42."
        # The continuation took the parked pages over and finished; everything is free again.
        wait_for(lambda: engine.stats().parked == 0 and engine.stats().running == 0 and engine.stats().pages_used == 0)
        assert scrape(server.url, GAUGE) == 0.0


def test_engine_steps_are_exported_by_kind():
    from prometheus_client import CollectorRegistry, generate_latest

    from agent_server.metrics import EngineCollector
    from inference.request import DurationHistogram, EngineStats, StepTimes

    class Engine:
        def stats(self):
            times = StepTimes(
                decode_steps=7,
                decode_seconds=0.5,
                mixed_steps=2,
                mixed_seconds=0.25,
                sync_steps=3,
                mixed_durations=DurationHistogram().record(0.03).record(0.2),
                token_gaps=DurationHistogram().record(0.013, 256).record(0.03, 200),
            )
            return EngineStats(step_times=times)

    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: Engine()))
    text = generate_latest(registry).decode()
    assert 'oss_agent_engine_steps_total{kind="decode"} 7.0' in text
    assert 'oss_agent_engine_steps_total{kind="mixed"} 2.0' in text
    assert 'oss_agent_engine_steps_total{kind="prefill"} 0.0' in text
    assert 'oss_agent_engine_step_seconds_total{kind="mixed"} 0.25' in text
    assert "oss_agent_engine_sync_steps_total 3.0" in text
    # Step durations and token gaps as Prometheus histograms, one bucket an octave.
    assert 'oss_agent_engine_step_duration_seconds_bucket{kind="mixed",le="0.015625"} 0.0' in text
    assert 'oss_agent_engine_step_duration_seconds_bucket{kind="mixed",le="0.03125"} 1.0' in text
    assert 'oss_agent_engine_step_duration_seconds_bucket{kind="mixed",le="0.25"} 2.0' in text
    assert 'oss_agent_engine_step_duration_seconds_count{kind="mixed"} 2.0' in text
    assert 'oss_agent_engine_step_duration_seconds_sum{kind="mixed"} 0.23' in text
    assert 'oss_agent_engine_step_duration_seconds_count{kind="prefill"} 0.0' in text
    assert 'oss_agent_engine_token_gap_seconds_bucket{le="0.015625"} 256.0' in text
    assert 'oss_agent_engine_token_gap_seconds_bucket{le="+Inf"} 456.0' in text
