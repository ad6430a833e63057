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
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        under_pressure = False
        # Prefill tokens this step may take (see the module docstring).
        prefill_budget = budget
        cap = self.max_prefill_tokens_decoding
        if cap is not None and any(seq.num_tokens - seq.num_computed == 1 for seq in self.running):
            prefill_budget = cap

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            decoding = seq.num_tokens - seq.num_computed == 1
            if decoding:
                wanted = min(1 + len(seq.draft_ids), budget)  # the drafts too, as far as budget allows
            else:
                wanted = min(seq.num_tokens - seq.num_computed, budget, prefill_budget)
                if wanted == 0:  # this step's prefill share is spent: its next chunk waits a step
                    i += 1
                    continue
            n = self.cache.fit_tokens(seq.pages, seq.num_computed, wanted)
            if n == 0:
                under_pressure = True
                if not self._make_room(protect=seq):
                    # Only this sequence's own pages are left to take: it waits instead.
                    self._preempt(seq)
                continue  # retry this index (or whichever sequence moved into it)
            self.cache.reserve(seq.pages, seq.num_computed, n)
            num_draft = n - 1 if decoding else 0
            del seq.draft_ids[num_draft:]  # drafts that did not fit are dropped, not deferred
            batch.seqs.append(seq)
            batch.num_new.append(n)
            batch.num_draft.append(num_draft)
            budget -= n
            if not decoding:
                prefill_budget -= n
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
        return batch

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
