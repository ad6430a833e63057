"""`StepClock`: each step charged the wall time from when the engine was free to start it."""

from __future__ import annotations

import math

import pytest

from inference.engine.step_clock import StepClock
from inference.request import DURATION_BOUNDS, DurationHistogram, StepTimes, step_kind


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_steps_are_charged_from_when_the_engine_was_free():
    t = FakeClock()
    clock = StepClock(clock=t)
    clock.planned()  # idle engine: the first step's time starts at its planning
    t.now += 0.020
    clock.done(1000, 1000, synchronous=True)  # a prompt alone
    t.now += 0.013
    clock.done(256, 0, synchronous=False)  # launched ahead: charged from the previous step's end
    clock.planned()  # (the engine is busy: planning does not restart the clock)
    t.now += 0.030
    clock.done(1280, 1024, synchronous=True)  # a prompt joining 256 decoding rows
    clock.idle()
    t.now += 5.0  # nothing to do for five seconds: charged to no step
    clock.planned()
    t.now += 0.012
    clock.done(256, 0, synchronous=True)
    times = clock.times
    assert (times.prefill_steps, times.prefill_tokens) == (1, 1000)
    assert (times.decode_steps, times.decode_tokens) == (2, 512)
    assert (times.mixed_steps, times.mixed_decode_tokens, times.mixed_prefill_tokens) == (1, 256, 1024)
    assert round(times.prefill_seconds, 6) == 0.020 and round(times.decode_seconds, 6) == 0.025
    assert round(times.mixed_seconds, 6) == 0.030
    assert times.sync_steps == 3 and round(times.sync_seconds, 6) == 0.062


def test_step_times_add_and_subtract_field_by_field():
    a = StepTimes(decode_steps=3, decode_seconds=0.5, sync_steps=1)
    b = StepTimes(decode_steps=1, decode_seconds=0.25, mixed_steps=2)
    assert a + b == StepTimes(decode_steps=4, decode_seconds=0.75, mixed_steps=2, sync_steps=1)
    assert (a + b) - b == a
    assert (a.steps("decode"), a.seconds("decode")) == (3, 0.5)
    assert [step_kind(8, 0), step_kind(8, 3), step_kind(8, 8)] == ["decode", "mixed", "prefill"]


def test_each_step_lands_in_its_kinds_histogram_and_decoding_rows_in_the_token_gaps():
    t = FakeClock()
    clock = StepClock(clock=t)
    clock.planned()
    for seconds, tokens, prefill, rows in [
        (0.020, 1000, 1000, 0),  # a prompt alone: no sequence was decoding, no gap
        (0.013, 256, 0, 256),
        (0.013, 256, 0, 256),
        (0.031, 1280, 1024, 256),  # a prompt joining: 256 sequences wait 31 ms for a token
        (0.012, 260, 0, 65),  # 65 sequences, some verifying drafts: a gap each, not a token each
    ]:
        t.now += seconds
        clock.done(tokens, prefill, synchronous=False, decode_rows=rows)
    times = clock.times
    assert [times.durations(k).count for k in ("decode", "mixed", "prefill")] == [3, 1, 1]
    assert times.token_gaps.count == 3 * 256 + 65
    assert times.token_gaps.total == pytest.approx(2 * 256 * 0.013 + 256 * 0.031 + 65 * 0.012)

    # Quantiles within a bucket's width (2^(1/4)) of the true value.
    def near(value, true):
        return true / 2**0.25 <= value <= true * 2**0.25

    assert near(times.token_gaps.quantile(0.99), 0.031) and near(times.token_gaps.quantile(0.5), 0.013)
    assert near(times.prefill_durations.quantile(0.5), 0.020) and near(times.decode_durations.quantile(0.01), 0.012)


def test_duration_histograms_add_subtract_and_read_out_as_prometheus_buckets():
    a = DurationHistogram().record(0.001).record(0.010, 3)
    b = DurationHistogram().record(100.0)  # past the last bound: the overflow bucket
    assert (a + b).count == 5 and ((a + b) - b).counts == a.counts
    assert (a + b).total == pytest.approx(100.031)
    assert (a + b).quantile(1.0) == DURATION_BOUNDS[-1]
    assert math.isnan(DurationHistogram().quantile(0.5))
    buckets = (a + b).cumulative(every=4)
    assert buckets[-1] == (math.inf, 5)
    assert [bound for bound, _ in buckets[:-1]] == [2.0**k for k in range(-12, 5)]
    # Cumulative: 1 ms is above 2^-10 s (0.98 ms) and below 2^-9; 10 ms below 2^-6 (15.6 ms).
    assert dict(buckets)[2.0**-10] == 0 and dict(buckets)[2.0**-9] == 1
    assert dict(buckets)[2.0**-6] == 4 and dict(buckets)[16.0] == 4
    # StepTimes add and subtract their histograms with the counters.
    x, y = StepTimes(decode_steps=1, token_gaps=a), StepTimes(decode_steps=2, token_gaps=b)
    assert (x + y).token_gaps.counts == (a + b).counts and ((x + y) - y).token_gaps.counts == a.counts
    assert ((x + y) - y).decode_steps == 1
