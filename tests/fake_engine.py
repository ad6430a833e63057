"""Scripted engines for server tests: they emit chosen Harmony token sequences.

`ScriptedEngine` implements `inference.request.EngineClient` the way the real engine behaves
at its boundary: one `TokenDelta` per token, the stop token included in `token_ids` and
reported in `stop_token_id`, `max_tokens` -> "length", `abort` -> "abort", parked sequences
for `keep_alive` / `continue_from`, and `num_cached_tokens` from a prefix cache (whole pages
of an earlier sequence) or, for a continuation, the whole parked sequence. Tests queue the
turns it should say with `say(...)` (Harmony text, special tokens allowed) and read back the
requests it got in `calls`.

`TeacherForcedEngine` makes the *real* engine say a script: each turn is submitted as the
prompt plus the script minus its last token, and that last token is forced with a logit bias
on a one-token generation. The engine then parks exactly prompt + script, so the agent loop's
continuations exercise the real engine's parking, page take-over and cache accounting.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from inference.request import EngineStats, GenerationRequest, TokenDelta, TokenLogprob
from inference.tokenizer import harmony_encoding

PAGE_SIZE = 16
DEFAULT_TURN = "<|channel|>final<|message|>OK.<|return|>"


def harmony_tokens(text: str) -> list[int]:
    return harmony_encoding().encode(text, allowed_special="all")


class ScriptedStream:
    """An async generator of deltas as a `DeltaStream`: it starts at the first iteration, and
    `open()` runs `on_open` (a wrapped real engine's own `open`) once."""

    def __init__(self, deltas: AsyncIterator[TokenDelta], on_open: Callable[[], None] | None = None):
        self.deltas = deltas
        self.on_open = on_open
        self.opened = False

    def open(self) -> None:
        if not self.opened:
            self.opened = True
            if self.on_open is not None:
                self.on_open()

    def __aiter__(self) -> "ScriptedStream":
        return self

    async def __anext__(self) -> TokenDelta:
        self.open()
        return await self.deltas.__anext__()

    async def aclose(self) -> None:
        await self.deltas.aclose()


@dataclass
class Call:
    """One generate() call as the engine saw it."""

    request: GenerationRequest
    num_cached_tokens: int
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_prefilled(self) -> int:
        return len(self.request.prompt_token_ids) - self.num_cached_tokens


class ScriptedEngine:
    model_name = "scripted"

    def __init__(self, *, max_model_len: int = 8192, vocab_size: int = 201088, token_delay: float = 0.0):
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_delay = token_delay  # seconds between tokens (lets tests cancel mid-stream)
        self.script: list[list[int] | Callable[[GenerationRequest], list[int]]] = []
        self.calls: list[Call] = []
        self.parked: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.aborted: set[str] = set()
        self.history: list[list[int]] = []  # finished sequences, for the prefix cache
        self.running = 0
        self.shut_down = False
        self._stats = EngineStats(pages_total=1024)

    # -- scripting ---------------------------------------------------------------------------

    def say(self, *turns: str | list[int] | Callable[[GenerationRequest], list[int]]) -> "ScriptedEngine":
        """Queue what the next generate() calls produce, one turn each."""
        for turn in turns:
            self.script.append(harmony_tokens(turn) if isinstance(turn, str) else turn)
        return self

    def _next_turn(self, request: GenerationRequest) -> list[int]:
        if not self.script:
            return harmony_tokens(DEFAULT_TURN)
        turn = self.script.pop(0)
        return turn(request) if callable(turn) else list(turn)

    # -- EngineClient --------------------------------------------------------------------------

    def _cached(self, request: GenerationRequest) -> int:
        prompt = request.prompt_token_ids
        parked = self.parked.pop(request.continue_from, None) if request.continue_from else None
        if parked is not None and prompt[: len(parked)] == parked:
            return len(parked) - 1  # the last sampled token was never fed through the model
        best = 0
        for seq in self.history:
            n = 0
            for a, b in zip(seq, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE

    def generate(self, request: GenerationRequest) -> ScriptedStream:
        if self.shut_down:
            raise RuntimeError("the engine is shut down")
        request.sampling.validate(self.vocab_size)
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt plus max_tokens is {total}, more than {self.max_model_len}")
        return ScriptedStream(self._stream(request))

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        cached = self._cached(request)
        call = Call(request, cached)
        self.calls.append(call)
        turn = self._next_turn(request)
        sampling = request.sampling
        prompt_len = len(request.prompt_token_ids)
        self.running += 1
        self._stats.prefix_queries_tokens += prompt_len
        self._stats.prefix_hit_tokens += cached
        self._stats.tokens_prefilled += prompt_len - cached

        def delta(tokens, finish=None, stop=None, logprobs=None):
            return TokenDelta(
                request.request_id,
                tokens,
                logprobs=logprobs,
                finish_reason=finish,
                stop_token_id=stop,
                num_prompt_tokens=prompt_len,
                num_cached_tokens=cached,
            )

        finish = None
        try:
            for token in turn:
                await asyncio.sleep(self.token_delay)
                if request.request_id in self.aborted:
                    finish = "abort"
                    yield delta([], "abort")
                    return
                call.generated.append(token)
                self._stats.tokens_decoded += 1
                logprobs = None
                if sampling.logprobs is not None:
                    # A made-up but consistent distribution: the chosen token at -0.25, then others.
                    top = [(token, -0.25)] + [((token + k) % self.vocab_size, -0.25 - k) for k in range(1, 20)]
                    logprobs = [TokenLogprob(token, -0.25, top[: sampling.logprobs])]
                if token in sampling.stop_token_ids:
                    finish = "stop"
                    yield delta([token], "stop", token, logprobs)
                    return
                if len(call.generated) >= sampling.max_tokens:
                    finish = "length"
                    yield delta([token], "length", None, logprobs)
                    return
                yield delta([token], logprobs=logprobs)
            # The script ran out without a stop token: behave as if the limit was reached.
            finish = "length"
            yield delta([], "length")
        finally:
            self.running -= 1
            call.finish_reason = finish or "abort"
            sequence = list(request.prompt_token_ids) + call.generated
            self.history.append(sequence)
            if request.keep_alive and call.finish_reason in ("stop", "length"):
                self.parked[request.request_id] = sequence

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        self.parked.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.parked.pop(request_id, None)

    def stats(self) -> EngineStats:
        s = self._stats
        s.running, s.parked = self.running, len(self.parked)
        s.pages_used = sum(math.ceil(len(seq) / PAGE_SIZE) for seq in self.parked.values())
        return s

    async def shutdown(self) -> None:
        self.shut_down = True


class TeacherForcedEngine:
    """A real `EngineClient` (e.g. `AsyncEngine` on a tiny checkpoint) made to say a script."""

    def __init__(self, engine):
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.script: list[list[int]] = []
        self.calls: list[Call] = []
        self.released: list[str] = []

    def say(self, *turns: str) -> "TeacherForcedEngine":
        self.script += [harmony_tokens(turn) for turn in turns]
        return self

    @property
    def running(self) -> int:
        return self.engine.stats().running

    def generate(self, request: GenerationRequest) -> ScriptedStream:
        script = self.script.pop(0) if self.script else harmony_tokens(DEFAULT_TURN)
        script = script[: request.sampling.max_tokens]
        forced = GenerationRequest(
            request.request_id,
            list(request.prompt_token_ids) + script[:-1],
            # (the script, not a grammar, says what comes: the turn grammar would refuse a malformed one)
            replace(
                request.sampling,
                temperature=0.0,
                max_tokens=1,
                logit_bias={script[-1]: 100.0},
                logprobs=None,
                grammar=None,
            ),
            keep_alive=request.keep_alive,
            continue_from=request.continue_from,
        )
        inner = self.engine.generate(forced)
        return ScriptedStream(self._stream(request, inner, script), on_open=inner.open)

    async def _stream(self, request: GenerationRequest, inner: AsyncIterator[TokenDelta], script: list[int]):
        last = None
        async for delta in inner:
            last = delta
        prompt_len = len(request.prompt_token_ids)
        cached = min(last.num_cached_tokens, prompt_len)
        call = Call(request, cached, finish_reason=last.finish_reason)
        self.calls.append(call)
        if last.finish_reason in ("error", "abort"):
            yield TokenDelta(
                request.request_id,
                [],
                finish_reason=last.finish_reason,
                error=last.error,
                num_prompt_tokens=prompt_len,
                num_cached_tokens=cached,
            )
            return
        assert last.token_ids == [script[-1]], "the logit bias did not force the script's last token"
        stop = script[-1] in request.sampling.stop_token_ids
        call.generated = list(script)
        call.finish_reason = "stop" if stop else "length"
        for i, token in enumerate(script):
            end = i == len(script) - 1
            yield TokenDelta(
                request.request_id,
                [token],
                finish_reason=call.finish_reason if end else None,
                stop_token_id=token if end and stop else None,
                num_prompt_tokens=prompt_len,
                num_cached_tokens=cached,
            )

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.engine.release(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def shutdown(self) -> None:
        await self.engine.shutdown()
