"""Where decode steps spend GPU time between kernels: the kernel timeline of a profiled run.

`timeline(activities, steps)` takes the GPU activities of a torch.profiler trace (kernels, copies
and memsets, each a name, a start and a duration in µs) covering `steps` consecutive engine steps
and returns, per step: how many activities ran, the time at least one ran (busy), the span from
the first start to the last end, the idle time (nothing running; span minus busy: what launches
and synchronisation cost the step), the idle gaps longer than `long_gap` µs grouped by the pair of
activities around them (host launches, copies between the copy and compute engines, a graph's
launch) with their median (a few late host launches make a large total from a small typical
gap), and each kernel name's total. Activities may overlap: copies on the copy engines, and
kernels launched as programmatic dependents, whose durations include their wait for the kernel
before them.

`bench_engine.py --timeline B` profiles the async engine at batch B and prints `format_timeline`.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LONG_GAP_US = 3.0


@dataclass
class Activity:
    name: str
    start: float  # µs
    duration: float  # µs


@dataclass
class Timeline:
    steps: int
    long_gap: float  # µs: gaps above this are listed
    activities: float  # a step
    busy_us: float  # a step: time at least one activity runs
    span_us: float  # a step: first start to last end
    gap_us: float  # a step: idle time (nothing runs)
    long_gaps: list[tuple[float, float, str, str]]  # (µs a step, median µs, before, after), largest first
    kernels: list[tuple[str, float, float]]  # (name, µs a step, launches a step), largest first


def gpu_activities(chrome_trace: dict) -> list[Activity]:
    """The GPU activities of a torch.profiler chrome trace (`export_chrome_trace`), in start order."""
    events = [e for e in chrome_trace.get("traceEvents", []) if e.get("cat") in GPU_CATEGORIES]
    return sorted((Activity(e["name"], float(e["ts"]), float(e["dur"])) for e in events), key=lambda a: a.start)


def load_activities(path: str) -> list[Activity]:
    with open(path) as f:
        return gpu_activities(json.load(f))


def timeline(
    activities: list[Activity], steps: int, long_gap: float = LONG_GAP_US, top: int = 10, name_width: int = 60
) -> Timeline:
    """Per-step figures of `activities` (start order) spread over `steps` steps; names are cut to
    `name_width` characters (C++ kernel names run to hundreds)."""
    if steps < 1 or not activities:
        raise ValueError("need at least one step and one activity")
    acts = sorted(activities, key=lambda a: a.start)
    span = max(a.start + a.duration for a in acts) - acts[0].start
    gaps = 0.0
    around: dict[tuple[str, str], list[float]] = defaultdict(list)
    last = acts[0]  # of the activities so far, the one that ends last
    for after in acts[1:]:
        gap = after.start - (last.start + last.duration)
        if gap > 0:
            gaps += gap
        if gap > long_gap:
            around[(last.name[:name_width], after.name[:name_width])].append(gap)
        if after.start + after.duration > last.start + last.duration:
            last = after
    busy = span - gaps
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for a in acts:
        totals[a.name[:name_width]] += a.duration
        counts[a.name[:name_width]] += 1
    long_gaps = sorted(((sum(g) / steps, statistics.median(g), b, a) for (b, a), g in around.items()), reverse=True)[
        :top
    ]
    kernels = sorted(((n, t / steps, counts[n] / steps) for n, t in totals.items()), key=lambda k: -k[1])[:top]
    return Timeline(steps, long_gap, len(acts) / steps, busy / steps, span / steps, gaps / steps, long_gaps, kernels)


def format_timeline(t: Timeline, title: str = "") -> str:
    lines = [title] if title else []
    lines.append(
        f"per step ({t.steps} steps): {t.activities:.1f} kernels and copies, busy {t.busy_us:,.0f} µs, "
        f"span {t.span_us:,.0f} µs, idle between them {t.gap_us:,.0f} µs"
    )
    lines.append(
        f"\n| gaps over {t.long_gap:g} µs: µs a step | median gap µs | after | before |\n| ---: | ---: | --- | --- |"
    )
    lines += [f"| {g:.1f} | {m:.1f} | {before} | {after} |" for g, m, before, after in t.long_gaps]
    lines.append("\n| kernel or copy | µs a step | launches a step |\n| --- | ---: | ---: |")
    lines += [f"| {name} | {us:,.1f} | {n:.1f} |" for name, us, n in t.kernels]
    return "\n".join(lines)
