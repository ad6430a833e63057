"""Where the engine's wall time goes, by kind of step.

Each step is charged the wall time from the moment the engine could start on it (the previous
step's tokens read, or the step's own scheduling when the engine had been idle) to the moment its
own tokens are read. So a busy engine's steps add up to its busy time, host work between steps
included: the scheduling, input preparation and launches of a step planned only after the
previous one's tokens were read (a synchronous step) are charged to that step, and a step
launched ahead (async scheduling) is charged only what is left of it once the previous one is read.

Kinds: `decode` (every row one decoded token, drafts included), `prefill` (prompt tokens only)
and `mixed` (both: a prompt joining running sequences, or a chunk of one). Serving benchmarks
read the totals before and after a run (`EngineStats.step_times`) to show where its time went.

Each kind also keeps a histogram of its steps' durations, and `token_gaps` one of the gaps
between a running sequence's tokens as the engine hands them out: each sequence decoding in a
step adds that step's time. Set beside the inter-token latency a client measures, it tells the
engine's share of a slow token from the delivery's (the pipe, the client's own pauses).
"""

from __future__ import annotations

import time

from inference.request import StepTimes, step_kind


class StepClock:
    """Charges each step its wall time (see the module docstring) into a `StepTimes`."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.times = StepTimes()
        self._free_at: float | None = None  # when the engine was last free to start the next step

    def idle(self) -> None:
        """The engine has nothing in flight: the next step's time starts at its own planning."""
        self._free_at = None

    def planned(self) -> None:
        """A step is being planned now: if the engine was idle, its time starts here."""
        if self._free_at is None:
            self._free_at = self.clock()

    def done(self, num_tokens: int, prefill_tokens: int, synchronous: bool, decode_rows: int = 0) -> None:
        """A step's tokens were read: charge it from when the engine was free to start it.
        `decode_rows`: the sequences that decoded in it (not those whose prompt it computed)."""
        now = self.clock()
        start = self._free_at if self._free_at is not None else now
        seconds, self._free_at = now - start, now
        t = self.times
        kind = step_kind(num_tokens, prefill_tokens)
        if kind == "decode":
            t.decode_steps += 1
            t.decode_seconds += seconds
            t.decode_tokens += num_tokens
        elif kind == "mixed":
            t.mixed_steps += 1
            t.mixed_seconds += seconds
            t.mixed_decode_tokens += num_tokens - prefill_tokens
            t.mixed_prefill_tokens += prefill_tokens
        else:
            t.prefill_steps += 1
            t.prefill_seconds += seconds
            t.prefill_tokens += prefill_tokens
        setattr(t, f"{kind}_durations", t.durations(kind).record(seconds))
        if decode_rows:
            t.token_gaps = t.token_gaps.record(seconds, decode_rows)
        if synchronous:
            t.sync_steps += 1
            t.sync_seconds += seconds
