"""`benchmarks/bench_scheduler.py`: the host's per-step scheduling work, driven as the engine
drives it, on tiny sizes."""

from __future__ import annotations

import sys

from tests.benchmark_scripts import BENCHMARKS, load_benchmark

sys.path.insert(0, str(BENCHMARKS))
bench_scheduler = load_benchmark("bench_scheduler")


def test_the_batch_decodes_and_every_step_is_launched_ahead():
    scheduler, cache = bench_scheduler.decoding_batch(8, 40, 20)
    assert len(scheduler.running) == 8 and not scheduler.waiting
    assert all(seq.num_tokens - seq.num_computed == 1 for seq in scheduler.running)  # all decoding
    r = bench_scheduler.time_steps(8, 40, 10)  # (asserts that every step was launched ahead)
    assert r["schedule_us"] > 0 and r["next_batch_us"] > 0
    assert scheduler.counters.preemptions == 0
