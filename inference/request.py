"""What callers hand the engine and what it hands back.

These plain dataclasses are the whole contract between the serving layer (agent_server) and the
engine: `Engine.generate(GenerationRequest)` streams `TokenDelta`s, `Engine.abort(request_id)` stops
one. Nothing here knows about HTTP, Harmony or tools.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, fields
from typing import AsyncIterator, Literal, Protocol

from inference.grammar import Grammar, check_grammar

FinishReason = Literal["stop", "length", "abort", "error"]

# Temperatures below this sample greedily, as 0 does: the limit they tend to. Far smaller ones
# would not survive float32 (1e-45 rounds to 0, and logits / 1e-40 overflow).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings. Defaults mean plain greedy-free sampling at temperature 1."""

    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0, say): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    # Number of top alternatives to return with each sampled token's logprob; None: no logprobs.
    logprobs: int | None = None
    # What the generated tokens must spell (`inference/grammar.py`); None: anything.
    grammar: Grammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def truncates(self) -> bool:
        """Whether top_k, top_p or min_p cut the distribution a sampled token is drawn from."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the field if a value is out of range."""
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")
        for tok in list(self.logit_bias) + list(self.stop_token_ids):
            if not 0 <= tok < vocab_size:
                raise ValueError(f"token id {tok} is outside the vocabulary")
        if self.grammar is not None:
            check_grammar(self.grammar)


@dataclass
class GenerationRequest:
    """One generation. `prompt_token_ids` is the full rendered prompt.

    Continuation (the agent loop's tool calls): with `keep_alive=True`, a finished request's
    sequence stays parked with its KV pages under `request_id` instead of being freed. A later
    request naming it in `continue_from` whose prompt starts with the parked sequence's tokens
    (prompt + generated) reuses those pages and prefills only the new suffix. `Engine.release`
    frees a parked sequence; an unused parked sequence may be evicted under memory pressure (the
    continuation then falls back to prefix reuse / recompute, never to wrong output).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    keep_alive: bool = False
    continue_from: str | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class TokenDelta:
    """New tokens for one request. The last delta of a request has `finish_reason` set.

    `num_prompt_tokens` and `num_cached_tokens` (prompt tokens served from cache, not prefilled)
    are filled on every delta so a consumer can read usage from any of them.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # which stop token ended it, when finish_reason == "stop"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # message when finish_reason == "error"


STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(num_tokens: int, prefill_tokens: int) -> str:
    """The kind of a step (`inference/engine/step_clock.py`) of `num_tokens` tokens,
    `prefill_tokens` of them prompt tokens."""
    if prefill_tokens == 0:
        return "decode"
    return "prefill" if prefill_tokens == num_tokens else "mixed"


# Upper bounds (seconds) of a `DurationHistogram`'s buckets: four an octave from 2^-12 s (0.24
# ms) to 16 s, so a quantile read from one is within its bucket's 19% of the true value.
DURATION_BOUNDS = tuple(2.0 ** (k / 4) for k in range(-48, 17))


@dataclass(frozen=True)
class DurationHistogram:
    """Durations in the buckets of `DURATION_BOUNDS`: `counts[i]` holds the weight of those in
    (bounds[i - 1], bounds[i]] seconds, the last count those above 16 s; `total` is the weighted
    sum of the durations. Immutable, so a snapshot of one is never changed by later steps."""

    counts: tuple[int, ...] = (0,) * (len(DURATION_BOUNDS) + 1)
    total: float = 0.0

    def record(self, seconds: float, weight: int = 1) -> DurationHistogram:
        """This histogram with `weight` more durations of `seconds`."""
        counts = list(self.counts)
        counts[bisect_left(DURATION_BOUNDS, seconds)] += weight
        return DurationHistogram(tuple(counts), self.total + seconds * weight)

    def __add__(self, other: DurationHistogram) -> DurationHistogram:
        return DurationHistogram(tuple(map(int.__add__, self.counts, other.counts)), self.total + other.total)

    def __sub__(self, other: DurationHistogram) -> DurationHistogram:
        return DurationHistogram(tuple(map(int.__sub__, self.counts, other.counts)), self.total - other.total)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float:
        """The duration (seconds) below which a share `q` of the weight lies, interpolated
        geometrically within its bucket; NaN when empty, 16 s and above as 16 s."""
        if not self.count:
            return float("nan")
        target, seen = q * self.count, 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= target:
                if i == len(DURATION_BOUNDS):
                    return DURATION_BOUNDS[-1]
                upper = DURATION_BOUNDS[i]
                lower = DURATION_BOUNDS[i - 1] if i else upper / 2**0.25
                return lower * (upper / lower) ** ((target - seen) / n)
            seen += n
        return DURATION_BOUNDS[-1]

    def cumulative(self, every: int = 1) -> list[tuple[float, int]]:
        """(bound, weight of durations <= bound) at every `every`-th bound, and (inf, all):
        the buckets of a Prometheus histogram."""
        out, running = [], 0
        for i, n in enumerate(self.counts[:-1]):
            running += n
            if i % every == 0:
                out.append((DURATION_BOUNDS[i], running))
        return out + [(float("inf"), running + self.counts[-1])]


@dataclass
class StepTimes:
    """Steps, wall seconds and tokens by kind since start, and how many steps were planned only
    after the previous step's tokens were read (synchronous) with their seconds.

    The histograms: each kind's step durations (a step weighs one), and `token_gaps`, the time
    between a running sequence's consecutive tokens as the engine hands them out (each sequence
    that decodes in a step weighs one, with that step's duration): the engine's share of the
    inter-token latency a client measures."""

    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # (drafts verified included)
    mixed_steps: int = 0
    mixed_seconds: float = 0.0
    mixed_decode_tokens: int = 0
    mixed_prefill_tokens: int = 0
    prefill_steps: int = 0
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    sync_steps: int = 0
    sync_seconds: float = 0.0
    decode_durations: DurationHistogram = DurationHistogram()
    mixed_durations: DurationHistogram = DurationHistogram()
    prefill_durations: DurationHistogram = DurationHistogram()
    token_gaps: DurationHistogram = DurationHistogram()

    def __add__(self, other: StepTimes) -> StepTimes:
        """Field by field (replicas' totals; a run's share is `after - before`)."""
        return StepTimes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: StepTimes) -> StepTimes:
        return StepTimes(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def steps(self, kind: str) -> int:
        return getattr(self, f"{kind}_steps")

    def seconds(self, kind: str) -> float:
        return getattr(self, f"{kind}_seconds")

    def durations(self, kind: str) -> DurationHistogram:
        return getattr(self, f"{kind}_durations")


@dataclass
class EngineStats:
    """A snapshot of engine counters for metrics (monotonic counters are totals since start)."""

    running: int = 0
    waiting: int = 0
    parked: int = 0
    pages_total: int = 0
    pages_used: int = 0
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found cached
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    preemptions: int = 0
    steps: int = 0
    # Speculative decoding: verification steps (one sequence's drafts checked in one step),
    # drafts checked, drafts kept. Mean acceptance length = (steps + accepted) / steps tokens.
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Steps by kind with the wall time each took (`inference/engine/step_clock.py`).
    step_times: StepTimes = field(default_factory=StepTimes)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (kept drafts + 1); 0 without speculation."""
        return (self.spec_steps + self.spec_accepted_tokens) / self.spec_steps if self.spec_steps else 0.0


class DeltaStream(Protocol):
    """One request's deltas, as `EngineClient.generate` returns them. The request reaches the
    engine at `open()` or at the first iteration, whichever comes first: a server opens it as
    soon as the prompt is ready, so the engine prefills while the response is being set up.
    Leaving early (`aclose()`, a cancelled wait) aborts the request."""

    def open(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    """What the serving layer needs from an engine (the real one or a scripted fake)."""

    model_name: str
    max_model_len: int
    vocab_size: int

    def generate(self, request: GenerationRequest) -> DeltaStream: ...

    def abort(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...


def check_request(request: GenerationRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError (with a message fit for a 400) if an engine of this vocabulary and context
    length cannot serve `request` (also checked where the engine is out of reach: `EngineProcess`)."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError("the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    request.sampling.validate(vocab_size)
    total = len(prompt) + request.sampling.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({request.sampling.max_tokens}) is "
            f"{total}, more than the model's context length {max_model_len}"
        )
