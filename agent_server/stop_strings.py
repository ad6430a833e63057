"""`stop` strings for Chat Completions: the engine stops on token ids, users give text.

Text is released as it streams except for a tail that could still grow into a stop string;
once one appears, everything from it on is dropped and generation is stopped by the caller.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit now (never part of a stop string)."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buffer = self.held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buffer[: min(hits)]
        keep = 0  # longest suffix of the buffer that begins some stop string
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), keep, -1):
                if buffer.endswith(stop[:n]):
                    keep = n
                    break
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self.held = ("" if self.stopped else self.held), ""
        return held
