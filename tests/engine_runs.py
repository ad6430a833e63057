"""Driving the synchronous engine (`LLMEngine`) to the end in tests."""

from __future__ import annotations


def drain(engine, on_step=None) -> dict[str, list]:
    """Step until idle; returns each request's deltas (`TokenDelta`s, in order). `on_step(engine)`
    runs after every step."""
    deltas: dict[str, list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
        if on_step:
            on_step(engine)
    return deltas


def tokens_of(deltas) -> list[int]:
    """The token ids of one request's deltas, in order."""
    return [t for d in deltas for t in d.token_ids]
