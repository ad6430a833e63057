"""The server's own view of a benchmark run, from its Prometheus `GET /metrics`.

`bench serve --server-metrics` scrapes before and after the measured run and reports the
difference: requests by status, prompt and generated tokens, and the server-side means of time
to first token (request arrival to first generated token, before any HTTP or Harmony work) and
time per output token (gaps between generated tokens). These are the `oss_agent_*` metrics of
agent_server/metrics.py; another server's /metrics is reported as unavailable.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

ENDPOINTS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by (name, sorted labels)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def scrape(client: httpx.AsyncClient, base_url: str) -> Samples | None:
    """The server's metrics now, or None when it has no Prometheus /metrics."""
    try:
        response = await client.get(f"{base_url}/metrics")
        if response.status_code != 200:
            return None
        return parse_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def _requests_served(samples: Samples) -> float:
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == "oss_agent_requests_total" and dict(ls).get("endpoint") != "/metrics"
    )


async def settled_scrape(
    client: httpx.AsyncClient, base_url: str, *, interval: float = 0.05, timeout: float = 2.0
) -> Samples | None:
    """Scrape once the request counters stop moving. A server counts a request after its last
    byte is sent, which can be just after the client has read it, so an immediate scrape may
    miss the requests that finished last."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    samples = await scrape(client, base_url)
    while samples is not None and loop.time() < deadline:
        await asyncio.sleep(interval)
        again = await scrape(client, base_url)
        if again is None or _requests_served(again) == _requests_served(samples):
            return again
        samples = again
    return samples


def _total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return _total(after, name, **labels) - _total(before, name, **labels)


def _mean_ms(before: Samples, after: Samples, histogram: str, **labels: str) -> float:
    count = _delta(before, after, f"{histogram}_count", **labels)
    return _delta(before, after, f"{histogram}_sum", **labels) / count * 1e3 if count else math.nan


def server_view(before: Samples | None, after: Samples | None, api: str) -> dict[str, Any] | None:
    """What the server counted between two scrapes (None when it exports no oss_agent metrics)."""
    if before is None or after is None or not any(n.startswith("oss_agent_") for n, _ in after):
        return None
    endpoint = ENDPOINTS[api]
    statuses = sorted(
        {
            dict(ls).get("status")
            for n, ls in after
            if n == "oss_agent_requests_total" and dict(ls).get("endpoint") == endpoint
        }
    )
    requests = {
        s: int(_delta(before, after, "oss_agent_requests_total", endpoint=endpoint, status=s)) for s in statuses
    }
    return {
        "requests_by_status": {s: n for s, n in requests.items() if n},
        "prompt_tokens": int(_delta(before, after, "oss_agent_prompt_tokens_total")),
        "cached_prompt_tokens": int(_delta(before, after, "oss_agent_cached_prompt_tokens_total")),
        "generation_tokens": int(_delta(before, after, "oss_agent_generation_tokens_total")),
        "ttft_count": int(_delta(before, after, "oss_agent_time_to_first_token_seconds_count")),
        "ttft_mean_ms": _mean_ms(before, after, "oss_agent_time_to_first_token_seconds"),
        "tpot_mean_ms": _mean_ms(before, after, "oss_agent_time_per_output_token_seconds"),
        "request_duration_mean_ms": _mean_ms(before, after, "oss_agent_request_duration_seconds", endpoint=endpoint),
    }


def format_server_view(view: dict[str, Any] | None) -> str:
    if view is None:
        return "server metrics: not available (no oss_agent_* metrics at /metrics)"
    rows = [
        ("requests by status", ", ".join(f"{s}: {n}" for s, n in view["requests_by_status"].items()) or "none"),
        ("prompt tokens (cached)", f"{view['prompt_tokens']:,} ({view['cached_prompt_tokens']:,})"),
        ("generated tokens", f"{view['generation_tokens']:,}"),
        ("mean TTFT, arrival to first token (ms)", f"{view['ttft_mean_ms']:,.2f}"),
        ("mean time per output token (ms)", f"{view['tpot_mean_ms']:,.2f}"),
        ("mean request duration (ms)", f"{view['request_duration_mean_ms']:,.2f}"),
    ]
    lines = ["the server's own metrics over the run (GET /metrics)", "", "| measure | value |", "| --- | ---: |"]
    return "\n".join(lines + [f"| {name} | {value} |" for name, value in rows])
