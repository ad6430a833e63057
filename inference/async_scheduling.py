"""Async scheduling: launch decode step N+1 before reading step N's tokens back.

A synchronous step leaves the device idle while the host reads the sampled ids, applies them
(stop checks, prefix-cache registration, deltas) and plans and prepares the next step. In a
steady decode batch the next step is known in advance except for its input tokens: every
sequence decodes one more token, one position further on. So the engine launches step N+1 right
after step N, with step N's sampled ids as inputs taken on the device (`ModelRunner.launch(...,
after=)`), and only then reads step N's ids; the host work of step N overlaps step N+1 on the
device. (vLLM's async scheduling and SGLang's overlap scheduler work the same way.)

What a follow-up step can get wrong is only known when step N's tokens arrive; it is handled then:
  * a sequence that stops at step N (a stop token) has a surplus row in step N+1: the engine
    drops that row (the sequence is no longer running) and frees the pages as usual. The surplus
    row writes K/V one position past the end, into a page only that sequence held; the device
    runs it before any later step that could reuse the page.
  * a sequence that will reach max_tokens or the context length at step N is known in advance
    and left out of step N+1.
Everything else falls back to the plain synchronous step, decided here (`next_batch` None):
batches with prefill chunks or drafts, penalties (the sampler needs the token history on the
host), a request waiting with room to be admitted, more running sequences than the token budget
holds, pages that do not fit. The next step runs the same sequences the scheduler would pick.
The engine does not build this at all with a drafter or under tensor parallelism.

One cost stays hidden in a launch: when a row truncates by top-k/top-p and the sampler's cheap
check cannot prove its candidates hold the kept set, it reads one flag from the device
(`inference/sampler.py`, `_top_k_top_p`), which waits for the step just launched. The output is
unchanged, but a batch with such rows overlaps less; greedy and plain temperature sampling never
take that path.
"""

from __future__ import annotations

from .kv_cache import KVCacheManager
from .scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus


class StepOverlap:
    """Decides whether the step after a launched one may be launched before its tokens are read,
    and plans that step (reserving its pages)."""

    def __init__(self, scheduler: Scheduler, cache: KVCacheManager, max_model_len: int):
        self.scheduler = scheduler
        self.cache = cache
        self.max_model_len = max_model_len

    @staticmethod
    def is_steady_decode(batch: ScheduledBatch) -> bool:
        """Every sequence decodes one token and samples the next, without drafts or penalties."""
        drafts = batch.num_draft or [0] * len(batch)
        return all(n == 1 and not d and StepOverlap._decodes_plainly(seq)
                   for seq, n, d in zip(batch.seqs, batch.num_new, drafts))

    @staticmethod
    def _decodes_plainly(seq: Sequence) -> bool:
        p = seq.sampling
        return seq.num_tokens - seq.num_computed == 1 and not (p.frequency_penalty or p.presence_penalty)

    def next_batch(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch` (launched, tokens not applied yet), its pages reserved;
        None when the synchronous scheduler must plan it once `batch`'s tokens are known."""
        s = self.scheduler
        if any(n != 1 for n in batch.num_new) or any(batch.num_draft):
            return None
        if s.waiting and len(s.running) < s.max_num_seqs:
            return None  # a new request may join: the scheduler admits it
        # Sequences that ended (or were aborted) before `batch` could be read have no next step.
        running = [seq for seq in batch.seqs if seq.status == SequenceStatus.RUNNING]
        if not all(self._decodes_plainly(seq) for seq in running):
            return None
        seqs = [seq for seq in running if not self._ends_now(seq)]
        if not seqs or len(seqs) > s.max_num_batched_tokens:
            return None
        for seq in seqs:  # `batch` writes position num_computed; the next step the one after it
            start = seq.num_computed + 1
            if self.cache.fit_tokens(seq.pages, start, 1) < 1:
                return None  # out of pages: the scheduler preempts, or parks, as it sees fit
            self.cache.reserve(seq.pages, start, 1)
        return ScheduledBatch(seqs, [1] * len(seqs), [0] * len(seqs))

    def _ends_now(self, seq: Sequence) -> bool:
        """Whether the token the launched step samples for `seq` is its last by length."""
        return seq.num_output_tokens + 1 >= seq.sampling.max_tokens or seq.num_tokens + 1 >= self.max_model_len
