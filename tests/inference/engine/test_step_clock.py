"""`StepClock`: each step charged the wall time from when the engine was free to start it."""

from __future__ import annotations

from inference.engine.step_clock import StepClock
from inference.request import StepTimes, step_kind


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
