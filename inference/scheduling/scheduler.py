"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step mixes decode and prefill under one token budget (`max_num_batched_tokens`):
running sequences go first, oldest first (a decode costs one token, an unfinished prefill takes
a chunk of what is left of the budget), then waiting sequences are admitted in arrival order
while the budget, `max_num_seqs` and free pages allow. While any sequence is decoding, prefill
(chunks of running prompts and admissions together) takes at most `max_prefill_tokens_decoding`
tokens a step: a prompt joining a busy batch then costs every running stream one bounded step
at a time, not a stall as long as the whole prompt's prefill; an idle engine prefills at the
full budget. A sequence processes
`token_ids[num_computed : num_computed + n]`; when that reaches its last token the step samples
its next token.

With async scheduling the engine plans each step before the previous one is applied
(`schedule_after`, `async_scheduling.py`): the same policy, every sequence starting where the
launched step leaves it.

When pages run out: parked sequences are evicted first, then waiting sequences that hold
pages drop them, then the newest running sequence is preempted: it frees its pages and goes
back to the front of the queue to be recomputed later (its generated tokens are kept, so the
output stream just continues). Nothing is dropped.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from inference.grammar import GrammarMatcher
from inference.request import SamplingParams
from inference.scheduling.kv_cache import KVCacheManager, PageTable


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens, progress and pages."""

    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    keep_alive: bool = False
    continue_from: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from cache on first admission (for usage)
    pages: PageTable = field(default_factory=PageTable)
    generator: torch.Generator | None = None  # own RNG for seeded requests
    counted_prefix: bool = False  # prefix-cache lookup already counted in the stats
    # Speculative decoding: tokens a drafter guessed to follow token_ids, verified next step.
    draft_ids: list[int] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # where a constrained request is in its grammar

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class ScheduledBatch:
    """One step's work: `num_new[i]` tokens of `seqs[i]`, starting at its `num_computed`.

    With speculative decoding the last `num_draft[i]` of those are the sequence's first draft
    tokens (`seqs[i].draft_ids`), to be verified; they are not in `token_ids` yet.
    """

    seqs: list[Sequence]
    num_new: list[int]
    num_draft: list[int] = field(default_factory=list)
    prefill_tokens: int = 0  # of sum(num_new), prompt tokens (the rest decode one token, or verify drafts)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class SchedulerCounters:
    prefix_queries_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    parked_evictions: int = 0


class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_tokens_decoding: int | None = None,
    ):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # None: prefill may take the whole budget even while sequences decode.
        self.max_prefill_tokens_decoding = max_prefill_tokens_decoding
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: OrderedDict[str, Sequence] = OrderedDict()  # oldest first
        self.counters = SchedulerCounters()

    # -- requests coming and going -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; a continuation takes over its parked predecessor's pages now."""
        parked = self.parked.pop(seq.continue_from, None) if seq.continue_from else None
        if parked is not None:
            reused = self.cache.take_over(parked.pages, parked.token_ids, parked.num_computed, seq.pages, seq.token_ids)
            parked.status = SequenceStatus.FINISHED
            seq.num_computed = reused
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in itertools.chain(self.running, self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def remove(self, seq: Sequence) -> None:
        """Take a waiting or running sequence out for good and free its pages."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.cache.release(seq.pages)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: park it (keep_alive) or free its pages."""
        self.running.remove(seq)
        if seq.keep_alive:
            old = self.parked.pop(seq.request_id, None)
            if old is not None:
                self.cache.release(old.pages)
            self.cache.trim_window(seq.pages, seq.num_computed)
            seq.status = SequenceStatus.PARKED
            self.parked[seq.request_id] = seq
        else:
            self.cache.release(seq.pages)
            seq.status = SequenceStatus.FINISHED

    def release_parked(self, request_id: str) -> bool:
        seq = self.parked.pop(request_id, None)
        if seq is None:
            return False
        self.cache.release(seq.pages)
        seq.status = SequenceStatus.FINISHED
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """The next step, every sequence where its last applied step left it."""
        batch = self._plan({}, frozenset(), ahead=False)
        assert batch is not None  # (only a plan ahead gives up)
        return batch

    def schedule_after(self, inflight: dict[Sequence, int], ending: frozenset[Sequence]) -> ScheduledBatch | None:
        """The step after one launched but not applied yet (async scheduling): `inflight` maps the
        running sequences in it to its tokens of theirs, each starting at its `num_computed`;
        `ending` holds those whose token sampled there is their last by length, which sit this
        step out. Each sequence starts where the launched step leaves it: one that the launched
        step samples decodes one token (its input is that sample, taken on the device); a
        prompt's next chunk follows the launched one. Rows decoding from a sample come first.
        None when pages run short: then only the synchronous scheduler may preempt or park."""
        batch = self._plan(inflight, ending, ahead=True)
        if batch is None or not batch.seqs:
            return None
        # The launched step's samples as inputs first (`ModelRunner.plan_after` takes them as a
        # leading block of rows), in the order the scheduler chose.
        follows = [seq in inflight and seq.num_computed + inflight[seq] == seq.num_tokens for seq in batch.seqs]
        if False not in follows or True not in follows[follows.index(False) :]:
            return batch  # (already so: a decode step, or one where prompts join behind the rows)
        order = sorted(range(len(batch.seqs)), key=lambda i: not follows[i])
        return ScheduledBatch(
            [batch.seqs[i] for i in order],
            [batch.num_new[i] for i in order],
            [batch.num_draft[i] for i in order],
            batch.prefill_tokens,
        )

    def _positions(self, inflight: dict[Sequence, int]) -> tuple[list[int], list[int]]:
        """Each running sequence's first position and tokens left to compute once the launched
        step (if any) is applied; one that step samples decodes one token."""
        if not inflight:
            starts = [seq.num_computed for seq in self.running]
            return starts, [seq.num_tokens - start for seq, start in zip(self.running, starts)]
        starts = [seq.num_computed + inflight.get(seq, 0) for seq in self.running]
        left = [
            1 if seq in inflight and start == seq.num_tokens else seq.num_tokens - start
            for seq, start in zip(self.running, starts)
        ]
        return starts, left

    def _plan(self, inflight: dict[Sequence, int], ending: frozenset[Sequence], ahead: bool) -> ScheduledBatch | None:
        """One step's batch (`inflight`, `ending`: see `schedule_after`); planned ahead, None where
        pages run short."""
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        under_pressure = False

        starts, left = self._positions(inflight)

        # Prefill tokens this step may take (see the module docstring).
        prefill_budget = budget
        cap = self.max_prefill_tokens_decoding
        if cap is not None and 1 in left:
            prefill_budget = cap

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq in ending:
                i += 1
                continue
            start = starts[i]
            decoding = left[i] == 1
            if decoding:
                wanted = min(1 + len(seq.draft_ids), budget)  # the drafts too, as far as budget allows
            else:
                wanted = min(left[i], budget, prefill_budget)
                if wanted == 0:  # this step's prefill share is spent: its next chunk waits a step
                    i += 1
                    continue
            n = self.cache.fit_tokens(seq.pages, start, wanted, ahead=ahead)
            if n == 0:
                if ahead:
                    return None
                under_pressure = True
                if not self._make_room(protect=seq):
                    # Only this sequence's own pages are left to take: it waits instead.
                    self._preempt(seq)
                starts, left = self._positions(inflight)  # (a sequence may have left `running`)
                continue  # retry this index (or whichever sequence moved into it)
            self.cache.reserve(seq.pages, start, n, ahead=ahead)
            num_draft = n - 1 if decoding else 0
            del seq.draft_ids[num_draft:]  # drafts that did not fit are dropped, not deferred
            batch.seqs.append(seq)
            batch.num_new.append(n)
            batch.num_draft.append(num_draft)
            budget -= n
            if not decoding:
                prefill_budget -= n
                batch.prefill_tokens += n
            i += 1

        # Admit new work only when no running sequence had to give up pages this step.
        while (
            self.waiting
            and min(budget, prefill_budget) > 0
            and len(self.running) < self.max_num_seqs
            and not under_pressure
        ):
            seq = self.waiting[0]
            matched_now = not seq.pages.holds_pages  # a continuation arrives holding pages
            if matched_now:
                self._match_prefix(seq)
                if ahead and self._prefix_grows_in_flight(seq, inflight):
                    # The launched step computes more of its prompt's prefix for another
                    # sequence: admitted once that is applied, it finds more of it cached.
                    self.cache.release(seq.pages)
                    seq.num_computed = 0
                    break
            wanted = min(seq.num_tokens - seq.num_computed, budget, prefill_budget)
            n = self.cache.fit_tokens(seq.pages, seq.num_computed, wanted)
            if n < wanted and not (n > 0 and not batch.seqs):
                # Admission needs room for the whole first chunk (unless the step would be
                # empty otherwise: then any progress will do). Waiting sequences hold no
                # pages (continuations excepted), so the cached ones just taken go back.
                if matched_now:
                    self.cache.release(seq.pages)
                    seq.num_computed = 0
                if self.parked:  # idle parked sequences never keep new work out
                    self._evict_parked()
                    continue
                if not self.running and self._drop_waiting_pages(keep=seq):
                    continue  # other continuations' pages were all that stood in the way
                break
            self.waiting.popleft()
            if not seq.counted_prefix:  # usage counts the first admission only
                seq.counted_prefix = True
                seq.num_cached_tokens = seq.num_computed
                self.counters.prefix_queries_tokens += seq.num_prompt_tokens
                self.counters.prefix_hit_tokens += seq.num_computed
            self.cache.reserve(seq.pages, seq.num_computed, n)
            seq.status = SequenceStatus.RUNNING
            seq.draft_ids.clear()  # drafts belong to a running sequence's last step
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            batch.num_draft.append(0)
            budget -= n
            prefill_budget -= n
            batch.prefill_tokens += n
        return batch

    def _prefix_grows_in_flight(self, seq: Sequence, inflight: dict[Sequence, int]) -> bool:
        """Whether the launched step completes, for a sequence in it, the first page of `seq`'s
        prompt that the prefix cache does not hold yet (same tokens up to that page's end)."""
        end = seq.num_computed + self.cache.page_size  # the end of the first page not matched
        if end > seq.num_tokens - 1:
            return False
        for other, k in inflight.items():
            if other.num_computed < end <= other.num_computed + k and other.token_ids[:end] == seq.token_ids[:end]:
                return True
        return False

    def _match_prefix(self, seq: Sequence) -> None:
        # Leave at least the last token to compute: its logits give the next token.
        cached = self.cache.match_prefix(seq.pages, seq.token_ids, seq.num_tokens - 1)
        seq.num_computed = cached

    def _make_room(self, protect: Sequence) -> bool:
        """Free some pages for `protect`; False when only its own pages are left to take."""
        if self.parked:
            self._evict_parked()
            return True
        if self._drop_waiting_pages(keep=None):
            return True
        victim = self.running[-1]
        if victim is protect:
            return False
        self._preempt(victim)
        return True

    def _drop_waiting_pages(self, keep: Sequence | None) -> bool:
        """Make the newest waiting sequence that holds pages (a continuation) give them up."""
        for seq in reversed(self.waiting):
            if seq is not keep and seq.pages.holds_pages:
                self.cache.release(seq.pages)
                seq.num_computed = 0
                return True
        return False

    def _evict_parked(self) -> None:
        _, seq = self.parked.popitem(last=False)
        self.cache.release(seq.pages)
        seq.status = SequenceStatus.FINISHED
        self.counters.parked_evictions += 1

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it will recompute its tokens when readmitted."""
        self.running.remove(seq)
        self.cache.release(seq.pages)
        seq.num_computed = 0
        seq.draft_ids.clear()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1
