"""Driving the engine in tests: the synchronous `LLMEngine` to the end, and the asyncio clients'
streams (`AsyncEngine`, `EngineProcess`)."""

from __future__ import annotations

import random

from inference.request import GenerationRequest, SamplingParams


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


def random_prompt(seed: int, length: int) -> list[int]:
    """`length` token ids drawn from the vocabulary's first 200,000, by seed."""
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(length)]


def greedy_request(rid: str, ids: list[int], max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens), **kw)


async def collect(stream) -> list:
    """Every delta of an engine client's stream."""
    return [delta async for delta in stream]
