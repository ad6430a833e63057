"""Prometheus metrics, scraped at `GET /metrics`.

Requests and their latency (per endpoint and status), time to first token and time per output
token, prompt / cached / generated token counts, tool calls by tool and outcome, and the
engine's own state (KV usage, prefix-cache hit rate, queue lengths) read at scrape time.
Each app has its own registry so several servers can live in one process (tests).
"""

from __future__ import annotations

import re
import time
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from agent_server.responses.dialect import PREFIX, api_path
from inference.request import STEP_KINDS, DurationHistogram, StepTimes, TokenDelta

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.5, 1, 2.5)
ID_SEGMENT = re.compile(r"/(resp|msg|rs|fc|ws|ci|mcp|chatcmpl|conv|item|fco|cmp|ctc|lsh|mcpl)_[A-Za-z0-9]+")


class EngineCollector:
    """Engine gauges and counters, read from `engine.stats()` when scraped."""

    def __init__(self, engine_getter):
        self.engine_getter = engine_getter

    def collect(self):
        engine = self.engine_getter()
        if engine is None:
            return
        s = engine.stats()
        gauges = {
            "oss_agent_engine_running_requests": ("Sequences being generated", s.running),
            "oss_agent_engine_waiting_requests": ("Sequences waiting to be scheduled", s.waiting),
            "oss_agent_engine_parked_sequences": ("Sequences parked for a continuation", s.parked),
            "oss_agent_kv_cache_usage_ratio": (
                "Fraction of KV pages in use",
                s.pages_used / s.pages_total if s.pages_total else 0.0,
            ),
            "oss_agent_prefix_cache_hit_ratio": (
                "Prompt tokens found in the prefix cache / looked up",
                s.prefix_hit_tokens / s.prefix_queries_tokens if s.prefix_queries_tokens else 0.0,
            ),
            "oss_agent_spec_decode_mean_acceptance_length": (
                "Speculative decoding: tokens emitted per verification step (kept drafts + 1; 0 when off)",
                s.mean_acceptance_length,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "oss_agent_prefix_cache_queried_tokens": (
                "Prompt tokens looked up in the prefix cache",
                s.prefix_queries_tokens,
            ),
            "oss_agent_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache", s.prefix_hit_tokens),
            "oss_agent_engine_preemptions": ("Sequences preempted for memory", s.preemptions),
            "oss_agent_spec_decode_verify_steps": (
                "Speculative decoding: sequence-steps that verified drafts",
                s.spec_steps,
            ),
            "oss_agent_spec_decode_draft_tokens": ("Speculative decoding: draft tokens verified", s.spec_draft_tokens),
            "oss_agent_spec_decode_accepted_tokens": (
                "Speculative decoding: draft tokens kept",
                s.spec_accepted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from step_families(s.step_times)
        replicas = getattr(engine, "replica_stats", None)
        if replicas is not None:  # data parallel: the totals above, and each replica here
            yield from replica_families(replicas())


def step_families(t: StepTimes):
    """Engine steps and their wall seconds by kind (decode, mixed, prefill), and the steps planned
    only after the previous one's tokens were read (`inference/engine/step_clock.py`)."""
    steps = CounterMetricFamily("oss_agent_engine_steps", "Engine steps, by kind", labels=["kind"])
    seconds = CounterMetricFamily(
        "oss_agent_engine_step_seconds", "Wall time engine steps took, by kind", labels=["kind"]
    )
    for kind in STEP_KINDS:
        steps.add_metric([kind], t.steps(kind))
        seconds.add_metric([kind], t.seconds(kind))
    sync = CounterMetricFamily(
        "oss_agent_engine_sync_steps", "Engine steps planned only after the previous step's tokens were read"
    )
    sync.add_metric([], t.sync_steps)
    durations = HistogramMetricFamily(
        "oss_agent_engine_step_duration_seconds", "Wall time of each engine step, by kind", labels=["kind"]
    )
    for kind in STEP_KINDS:
        durations.add_metric([kind], *histogram_buckets(t.durations(kind)))
    gaps = HistogramMetricFamily(
        "oss_agent_engine_token_gap_seconds",
        "Time between a running sequence's consecutive tokens as the engine hands them out "
        "(each sequence decoding in a step counts once, with that step's wall time)",
    )
    gaps.add_metric([], *histogram_buckets(t.token_gaps))
    yield from (steps, seconds, sync, durations, gaps)


def histogram_buckets(h: DurationHistogram) -> tuple[list[tuple[str, int]], float]:
    """A `DurationHistogram` as a Prometheus histogram's (buckets, sum): one bucket an octave
    (0.24 ms to 16 s, and +Inf), a quarter of the bounds it keeps."""
    return [(floatToGoString(bound), count) for bound, count in h.cumulative(every=4)], h.total


def replica_families(rows):
    """Per-replica gauges and counters (label `replica`) of a `ReplicaRouter`."""
    up = GaugeMetricFamily("oss_agent_replica_up", "1 while the engine replica is in rotation", labels=["replica"])
    running = GaugeMetricFamily(
        "oss_agent_replica_running_requests", "Sequences being generated, per replica", labels=["replica"]
    )
    waiting = GaugeMetricFamily(
        "oss_agent_replica_waiting_requests", "Sequences waiting to be scheduled, per replica", labels=["replica"]
    )
    kv = GaugeMetricFamily("oss_agent_replica_kv_cache_usage_ratio", "Fraction of KV pages in use", labels=["replica"])
    hit = GaugeMetricFamily(
        "oss_agent_replica_prefix_cache_hit_ratio",
        "Prompt tokens found in the prefix cache / looked up, per replica",
        labels=["replica"],
    )
    decoded = CounterMetricFamily(
        "oss_agent_replica_generation_tokens", "Tokens generated, per replica", labels=["replica"]
    )
    routed = CounterMetricFamily(
        "oss_agent_replica_routed_requests", "Requests routed to the replica, by why", labels=["replica", "reason"]
    )
    for index, live, s, counters in rows:
        label = str(index)
        up.add_metric([label], 1.0 if live else 0.0)
        by_load = counters.routed - counters.routed_by_prefix - counters.routed_by_continuation
        for reason, value in (
            ("prefix", counters.routed_by_prefix),
            ("continuation", counters.routed_by_continuation),
            ("load", by_load),
        ):
            routed.add_metric([label, reason], value)
        if s is None:
            continue
        running.add_metric([label], s.running)
        waiting.add_metric([label], s.waiting)
        kv.add_metric([label], s.pages_used / s.pages_total if s.pages_total else 0.0)
        hit.add_metric([label], s.prefix_hit_tokens / s.prefix_queries_tokens if s.prefix_queries_tokens else 0.0)
        decoded.add_metric([label], s.tokens_decoded)
    yield from (up, running, waiting, kv, hit, decoded, routed)


class Metrics:
    def __init__(self, engine_getter=lambda: None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("oss_agent_requests", "HTTP requests served", ["endpoint", "status"], registry=r)
        self.request_latency = Histogram(
            "oss_agent_request_duration_seconds",
            "Request latency, to the last byte",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "oss_agent_time_to_first_token_seconds",
            "Time from request to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            "oss_agent_time_per_output_token_seconds",
            "Time between generated tokens",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("oss_agent_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter("oss_agent_cached_prompt_tokens", "Prompt tokens served from cache", registry=r)
        self.generated_tokens = Counter("oss_agent_generation_tokens", "Tokens generated", registry=r)
        self.tool_calls = Counter("oss_agent_tool_calls", "Built-in tool calls", ["tool", "outcome"], registry=r)
        r.register(EngineCollector(engine_getter))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def observe_generation(
        self, deltas: AsyncIterator[TokenDelta], started: float | None
    ) -> AsyncIterator[TokenDelta]:
        """Pass deltas through, timing them; `started` is when the request arrived (None for a
        continuation turn, whose first token is not a user-visible first token)."""
        last = None
        prompt = cached = generated = 0
        try:
            async for delta in deltas:
                now = time.perf_counter()
                if delta.token_ids:
                    if last is None and started is not None:
                        self.ttft.observe(now - started)
                    elif last is not None:
                        gap = (now - last) / len(delta.token_ids)
                        for _ in delta.token_ids:
                            self.per_token.observe(gap)
                    last = now
                prompt, cached = delta.num_prompt_tokens, delta.num_cached_tokens
                generated += len(delta.token_ids)
                yield delta
        finally:
            self.prompt_tokens.inc(prompt)
            self.cached_tokens.inc(cached)
            self.generated_tokens.inc(generated)


KNOWN_ENDPOINTS = {
    "/v1/responses",
    "/v1/responses/{id}",
    "/v1/responses/{id}/cancel",
    "/v1/responses/{id}/input_items",
    "/v1/responses/compact",
    "/v1/responses/input_tokens",
    "/v1/conversations",
    "/v1/conversations/{id}",
    "/v1/conversations/{id}/items",
    "/v1/conversations/{id}/items/{id}",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
}


def endpoint_label(path: str) -> str:
    """The route of a path, ids replaced; "other" for unknown paths (bounded label values). The
    Responses API under /openresponses (responses/dialect.py) keeps its prefix."""
    label = ID_SEGMENT.sub(lambda m: "/{id}", path.rstrip("/") or "/")
    known = label in KNOWN_ENDPOINTS
    if label.startswith(PREFIX + "/"):
        base = api_path(label)
        known = base.startswith("/v1/responses") and base in KNOWN_ENDPOINTS
    return label if known else "other"


class MetricsMiddleware:
    """Counts every HTTP request and times it until its last body byte (streams included)."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status: dict[str, Any] = {"code": 500}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            endpoint = endpoint_label(scope["path"])
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.request_latency.labels(endpoint).observe(time.perf_counter() - started)
