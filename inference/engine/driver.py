"""The loop an engine's owner runs between handing deltas out: commands in, one step, deltas out.

`AsyncEngine` (a thread of the server's process, `inference/engine/async_engine.py`) and
`EngineProcess` (a process of its own, `inference/engine/process.py`) both drive their
`LLMEngine` through an `EngineDriver`, so the two behave the same.
"""

from __future__ import annotations

import logging

from inference.engine.core import LLMEngine
from inference.request import TokenDelta

log = logging.getLogger(__name__)


class EngineDriver:
    """What the owner of an `LLMEngine` does between handing deltas out (`AsyncEngine`'s thread,
    `EngineProcess`'s process): apply the callers' commands, run a step, keep serving through
    failures. Commands are tuples: ("add", request), ("abort", request_id),
    ("release", request_id), ("stop",)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def apply(self, command: tuple) -> tuple[list[TokenDelta], bool]:
        """(the deltas it made, whether it was "stop"). An "add" that fails ends its request with
        an "error" delta; any other failing command is logged."""
        kind = command[0]
        try:
            if kind == "add":
                request = command[1]
                try:
                    self.engine.add_request(request)
                except Exception as e:
                    return [
                        TokenDelta(
                            request.request_id,
                            [],
                            finish_reason="error",
                            error=str(e),
                            num_prompt_tokens=len(request.prompt_token_ids),
                        )
                    ], False
            elif kind == "abort":
                delta = self.engine.abort(command[1])
                return ([] if delta is None else [delta]), False
            elif kind == "release":
                self.engine.release(command[1])
            elif kind == "stop":
                return [], True
        except Exception:
            log.exception("engine command %s failed", kind)
        return [], False

    def step(self) -> tuple[list[TokenDelta], bool]:
        """One step, if there is work: (its deltas, stalled). Stalled: nothing could be scheduled
        (should not happen), so the caller should wait a little rather than spin. A bug fails
        what is in flight, and the engine keeps serving."""
        engine = self.engine
        if not engine.has_unfinished():
            return [], False
        steps, collecting = engine.steps, engine.in_flight
        try:
            deltas = engine.step()
        except Exception as e:
            log.exception("engine loop failed")
            return engine.fail_all(f"{type(e).__name__}: {e}"), False
        return deltas, engine.steps == steps and not collecting

    def run_pass(self, commands: list[tuple]) -> tuple[list[TokenDelta], bool, bool]:
        """One pass of an owner's loop: apply `commands` in order, then run a step, or after a
        "stop" end every request instead. Returns (the deltas, in order; stopped; stalled, see
        `step`)."""
        deltas: list[TokenDelta] = []
        stop = False
        for command in commands:
            made, stopped = self.apply(command)
            deltas += made
            stop |= stopped
        if stop:
            return deltas + self.abort_all(), True, False
        made, stalled = self.step()
        return deltas + made, False, stalled

    def abort_all(self) -> list[TokenDelta]:
        """End every request ("abort") and free the parked sequences: the engine is stopping."""
        engine = self.engine
        try:
            deltas = [engine.abort(request_id) for request_id in engine.live_request_ids()]
            for request_id in list(engine.scheduler.parked):
                engine.release(request_id)
            return [d for d in deltas if d is not None]
        except Exception as e:
            log.exception("engine loop failed")
            return engine.fail_all(f"{type(e).__name__}: {e}")
