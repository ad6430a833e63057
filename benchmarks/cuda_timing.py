"""Timing GPU work for the benchmarks: CUDA events, and CUDA-graph replays that leave out the
host's launch overhead (as the engine's decode steps run)."""

from __future__ import annotations

import statistics

import torch

from inference.runner.cuda_graphs import record_graph


def time_events(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over `reps` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def window_seconds(fn, reps: int, warmup: int) -> float:
    """Seconds per fn(): `warmup` calls, then one window of `reps` calls back to back between two
    CUDA events (consecutive calls overlap, as the engine's steps do, where `time_events` syncs
    around each). fn is typically a captured graph's `replay`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def graph_replay_seconds(fn, reps: int, warmup: int = 3) -> float:
    """Seconds per fn(), captured once in a CUDA graph the way the engine captures its steps
    (`record_graph`, after one call outside it, which compiles) and replayed `reps` times back to
    back in one `window_seconds` window."""
    graph, _ = record_graph(fn, warmups=1)
    return window_seconds(graph.replay, reps, warmup)


def time_graph_calls(run, rotations: int, calls: int) -> float:
    """Seconds per run(i), i = 0..calls-1, replayed from one CUDA graph (`record_graph`, after
    one pass outside it: compiles, allocations), each replay timed alone with `time_events`.
    Callers rotate over `rotations` inputs with `i % rotations`, so that large shapes are not
    just timing L2."""
    graph, _ = record_graph(lambda: [run(i) for i in range(calls)], warmups=1)
    seconds = time_events(graph.replay, reps=10) / calls
    del graph
    return seconds


def time_graph(fn, calls: int = 10) -> float:
    """Seconds per fn() replayed from a CUDA graph: device time without host launch overhead."""
    return time_graph_calls(lambda i: fn(), 1, calls)
