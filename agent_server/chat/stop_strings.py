"""`stop` strings for Chat Completions: the engine stops on token ids, users give text.

Text is released as it streams except for a tail that could still grow into a stop string;
once one appears, everything from it on is dropped and generation is stopped by the caller.
That tail is tracked per stop string by a Knuth-Morris-Pratt automaton over the text streamed
so far (its state: the longest suffix of the text that begins the stop string), so a token
costs time linear in the held tail and its own text, not in their product with the stop
strings' lengths.
"""

from __future__ import annotations


def _failure(pattern: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of pattern[: i + 1] that is also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.failures = [_failure(s) for s in self.stops]
        self.states = [0] * len(self.stops)  # per stop: matched length at the end of the text so far
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
        for k, (stop, fail) in enumerate(zip(self.stops, self.failures)):
            q = self.states[k]
            for ch in text:
                while q and stop[q] != ch:
                    q = fail[q - 1]
                if stop[q] == ch:
                    q += 1  # < len(stop): a whole match would have been found above
            self.states[k] = q
        keep = max(self.states)  # the longest suffix that begins some stop string
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self.held = ("" if self.stopped else self.held), ""
        return held
