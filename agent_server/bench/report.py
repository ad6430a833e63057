"""Benchmark results: what each request measured, and the summary table both benchmarks print.

Definitions (per request; times on one `time.perf_counter` clock, reported in milliseconds):
  TTFT   time from sending the request to the first streamed output (text, reasoning or tool
         arguments; for the engine benchmark, the first token)
  TPOT   (e2e - TTFT) / (output tokens - 1): the mean time per token after the first
  ITL    the gaps between consecutive streamed deltas (one value per gap, pooled over requests)
  e2e    time from sending the request to the end of its stream
Throughputs divide token totals by the benchmark's duration (first request sent to last one
finished). Peak output throughput is the most output tokens finished within one second of the
run, each request's tokens spread evenly over its streamed deltas.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from inference.request import STEP_KINDS, DurationHistogram, StepTimes

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end latency"))


@dataclass
class RequestResult:
    """One request as the client saw it."""

    prompt_len: int  # o200k tokens of the prompt text we sent
    output_len: int  # tokens asked for
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # perf_counter when it was sent
    ttft: float | None = None  # seconds
    e2e: float | None = None  # seconds
    delta_times: list[float] = field(default_factory=list)  # perf_counter of each delta with output
    input_tokens: int | None = None  # prompt tokens as the server counted them (template included)
    output_tokens: int = 0
    output_counted_by: str = "usage"  # "usage" (server-reported), "o200k" (our count), "engine"
    finish_reason: str | None = None
    response_id: str | None = None
    text: str = ""  # the streamed output text (content, reasoning and tool arguments)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.delta_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between order statistics."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {
        "mean": sum(ms) / len(ms) if ms else math.nan,
        "median": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


def peak_output_throughput(results: list[RequestResult], start: float) -> float:
    """Most output tokens finished within one whole second since `start` (tokens/s)."""
    buckets: Counter[int] = Counter()
    for r in results:
        if not r.ok or not r.output_tokens:
            continue
        times = r.delta_times or [r.start + (r.e2e or 0.0)]
        share = r.output_tokens / len(times)
        for t in times:
            buckets[int(t - start)] += share
    return max(buckets.values(), default=0.0)


def summarize(results: list[RequestResult], duration: float, start: float, **header: Any) -> dict[str, Any]:
    """The numbers both benchmarks print and write with --json; `header` describes the run."""
    good = [r for r in results if r.ok]
    errors = Counter(r.error or "unknown error" for r in results if not r.ok)
    reported = [r for r in good if r.input_tokens is not None]
    if good and len(reported) == len(good):
        input_tokens, input_counted_by = sum(r.input_tokens for r in good), "usage"
    else:
        input_tokens, input_counted_by = sum(r.prompt_len for r in good), "o200k (prompt text only)"
    output_tokens = sum(r.output_tokens for r in good)
    counted_by = sorted({r.output_counted_by for r in good})
    summary: dict[str, Any] = {
        **header,
        "num_prompts": len(results),
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": dict(errors.most_common(5)),
        "duration_s": duration,
        "total_prompt_text_tokens": sum(r.prompt_len for r in good),
        "total_input_tokens": input_tokens,
        "input_tokens_counted_by": input_counted_by,
        "total_output_tokens": output_tokens,
        "output_tokens_counted_by": "+".join(counted_by) or "none",
        "request_throughput": len(good) / duration if duration > 0 else math.nan,
        "input_throughput": input_tokens / duration if duration > 0 else math.nan,
        "output_throughput": output_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else math.nan,
        "peak_output_throughput": peak_output_throughput(good, start),
        "ttft_ms": distribution_ms([r.ttft for r in good if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in good if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in good for gap in r.itls]),
        "e2e_ms": distribution_ms([r.e2e for r in good if r.e2e is not None]),
    }
    return summary


def json_safe(value: Any) -> Any:
    """The summary as strict JSON: NaN (no data) becomes null, an infinite rate "inf"."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _number(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_summary(summary: dict[str, Any], title: str) -> str:
    """The summary as two markdown tables (totals and rates, then latency distributions)."""
    rows = [
        ("successful requests", summary["completed"]),
        ("failed requests", summary["failed"]),
        ("benchmark duration (s)", summary["duration_s"]),
        (f"input tokens ({summary['input_tokens_counted_by']})", summary["total_input_tokens"]),
        (f"output tokens ({summary['output_tokens_counted_by']})", summary["total_output_tokens"]),
        ("request throughput (req/s)", summary["request_throughput"]),
        ("input token throughput (tok/s)", summary["input_throughput"]),
        ("output token throughput (tok/s)", summary["output_throughput"]),
        ("peak output throughput (tok/s)", summary["peak_output_throughput"]),
        ("total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    lines = [title, "", "| measure | value |", "| --- | ---: |"]
    lines += [f"| {name} | {_number(value)} |" for name, value in rows]
    lines += ["", "| latency (ms) | mean | median | p90 | p99 |", "| --- | ---: | ---: | ---: | ---: |"]
    for key, name in LATENCIES:
        d = summary[f"{key}_ms"]
        lines.append(f"| {name} | " + " | ".join(_number(d[s]) for s in ("mean", "median", "p90", "p99")) + " |")
    for message, count in summary["errors"].items():
        lines.append(f"\nfailed x{count}: {message}")
    return "\n".join(lines)


def engine_steps(times: StepTimes, duration: float) -> dict[str, Any]:
    """A run's engine steps (`after - before` of `EngineStats.step_times`) by kind: how many, the
    wall seconds they took, their share of the run's `duration`, the mean step in ms and its
    tokens; and the steps planned only after the previous one's tokens were read (synchronous)."""

    def row(steps: int, seconds: float, durations: DurationHistogram | None = None, **tokens: int) -> dict[str, Any]:
        return {
            "steps": steps,
            "seconds": seconds,
            "share": seconds / duration if duration > 0 else math.nan,
            "mean_ms": 1e3 * seconds / steps if steps else math.nan,
            **{name: value / steps if steps else math.nan for name, value in tokens.items()},
            **(quantiles_ms(durations) if durations is not None else {}),
        }

    t = times
    return {
        "decode": row(t.decode_steps, t.decode_seconds, t.decode_durations, mean_decode_tokens=t.decode_tokens),
        "mixed": row(
            t.mixed_steps,
            t.mixed_seconds,
            t.mixed_durations,
            mean_decode_tokens=t.mixed_decode_tokens,
            mean_prefill_tokens=t.mixed_prefill_tokens,
        ),
        "prefill": row(t.prefill_steps, t.prefill_seconds, t.prefill_durations, mean_prefill_tokens=t.prefill_tokens),
        "synchronous": row(t.sync_steps, t.sync_seconds),
        "idle": {"seconds": duration - sum(t.seconds(k) for k in STEP_KINDS)},
        "token_gaps_ms": quantiles_ms(t.token_gaps),
    }


def quantiles_ms(h: DurationHistogram) -> dict[str, float]:
    """The median, p90 and p99 of a duration histogram, in ms (NaN when empty)."""
    return {name: 1e3 * h.quantile(q) for name, q in (("median_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99))}


def format_engine_steps(steps: dict[str, Any]) -> str:
    """`engine_steps` as a markdown table."""
    lines = [
        "where the engine's time went (steps by kind; synchronous: planned after the previous step's tokens were read)",
        "",
        "| steps | count | seconds | of the run | mean ms | median ms | p99 ms | decode tokens a step | prefill tokens a step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in (*STEP_KINDS, "synchronous"):
        r = steps[kind]
        cells = [
            str(r["steps"]),
            _number(r["seconds"]),
            f"{r['share']:.1%}",
            _number(r["mean_ms"]),
            _number(r.get("median_ms", math.nan)),
            _number(r.get("p99_ms", math.nan)),
            _number(r.get("mean_decode_tokens", math.nan), 1),
            _number(r.get("mean_prefill_tokens", math.nan), 1),
        ]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append(f"\nengine idle or waiting for requests: {steps['idle']['seconds']:.2f} s")
    gaps = steps["token_gaps_ms"]
    lines.append(
        f"gaps between a sequence's tokens as the engine hands them out: median {_number(gaps['median_ms'])}, "
        f"p90 {_number(gaps['p90_ms'])}, p99 {_number(gaps['p99_ms'])} ms (the ITL less what delivery adds)"
    )
    return "\n".join(lines)
