"""The kernel-timeline analysis of `benchmarks/step_timeline.py` (what `bench_engine.py --timeline`
prints), on a synthetic profiler trace."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

step_timeline = load_benchmark("step_timeline")


def chrome_trace(events):
    """A chrome trace with the given (category, name, start, duration) events, CPU ones mixed in."""
    trace = [{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur} for cat, name, ts, dur in events]
    trace.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500})
    trace.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 9})
    return {"traceEvents": trace}


# Two steps of: graph kernels a, b (0.5 µs apart), then a copy and a small kernel outside the graph
# after longer gaps. Listed out of order: the parser sorts by start.
EVENTS = [
    ("kernel", "a", 0.0, 10.0),
    ("kernel", "b", 10.5, 20.0),
    ("gpu_memcpy", "Memcpy DtoH", 35.5, 2.0),
    ("kernel", "fill", 41.5, 1.0),
    ("kernel", "a", 50.0, 10.0),
    ("kernel", "b", 60.5, 20.0),
    ("gpu_memcpy", "Memcpy DtoH", 85.5, 2.0),
    ("kernel", "fill", 91.5, 1.0),
]


def test_gpu_activities_keep_only_gpu_events_in_start_order(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace(list(reversed(EVENTS)))))
    acts = step_timeline.load_activities(str(path))
    assert [a.name for a in acts] == [e[1] for e in EVENTS]
    assert acts[2] == step_timeline.Activity("Memcpy DtoH", 35.5, 2.0)


def test_timeline_per_step_figures():
    acts = step_timeline.gpu_activities(chrome_trace(EVENTS))
    t = step_timeline.timeline(acts, steps=2, long_gap=3.0)
    assert t.activities == 4
    assert t.busy_us == pytest.approx(33.0)  # 10 + 20 + 2 + 1, nothing overlapping
    assert t.span_us == pytest.approx(92.5 / 2)
    # Gaps: 0.5, 5.0, 4.0, then 7.5 into step 2, then 0.5, 5.0, 4.0.
    assert t.gap_us == pytest.approx((0.5 + 5.0 + 4.0 + 7.5 + 0.5 + 5.0 + 4.0) / 2)
    assert t.long_gaps == [(5.0, 5.0, "b", "Memcpy DtoH"), (4.0, 4.0, "Memcpy DtoH", "fill"), (3.75, 7.5, "fill", "a")]
    assert t.kernels[0] == ("b", 20.0, 1.0) and t.kernels[1] == ("a", 10.0, 1.0)
    text = step_timeline.format_timeline(t, "title")
    assert text.startswith("title\n") and "| 5.0 | 5.0 | b | Memcpy DtoH |" in text and "| b | 20.0 | 1.0 |" in text


def test_timeline_cuts_long_names_and_rejects_empty_input():
    acts = [step_timeline.Activity("k" * 300, 0.0, 1.0), step_timeline.Activity("k" * 300, 10.0, 1.0)]
    t = step_timeline.timeline(acts, steps=1, name_width=20)
    assert t.kernels == [("k" * 20, 2.0, 2.0)] and t.long_gaps == [(9.0, 9.0, "k" * 20, "k" * 20)]
    with pytest.raises(ValueError):
        step_timeline.timeline([], steps=1)
    with pytest.raises(ValueError):
        step_timeline.timeline(acts, steps=0)


def test_overlapping_activities_count_once_and_leave_no_false_gaps():
    """A copy on the copy engine beside a kernel, and a dependent kernel launched before the
    previous one ends: busy is the time anything runs, gaps are times nothing does."""
    acts = [
        step_timeline.Activity("long", 0.0, 100.0),
        step_timeline.Activity("copy", 10.0, 5.0),
        step_timeline.Activity("dependent", 90.0, 30.0),
        step_timeline.Activity("next", 126.0, 4.0),
    ]
    t = step_timeline.timeline(acts, steps=1, long_gap=3.0)
    assert t.span_us == pytest.approx(130.0)
    assert t.busy_us == pytest.approx(124.0)  # [0, 120) and [126, 130)
    assert t.gap_us == pytest.approx(6.0)
    assert t.long_gaps == [(6.0, 6.0, "dependent", "next")]  # not "copy" -> "dependent" (75 µs)
    assert t.kernels[0] == ("long", 100.0, 1.0)
