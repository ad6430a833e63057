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
The launched step may hold prompts too (requests that joined the running ones): a prompt that
ends in it samples its first token there and decodes in the next step like the others.
Everything else falls back to the scheduler's plan once the tokens are read (`next_batch`
None): a prompt chunk that stops short of the prompt's end, drafts, penalties (the sampler needs
the token history on the host), a request waiting with room to be admitted, more running
sequences than the token budget holds, pages that do not fit. The next step runs the same
sequences the scheduler would pick.
The engine does not build this at all with a drafter or under tensor parallelism.

One cost stays hidden in a launch: when a row truncates by top-k/top-p and the sampler's cheap
check cannot prove its candidates hold the kept set, it reads one flag from the device
(`inference/sample/sampler.py`, `_top_k_top_p`), which waits for the step just launched. The output is
unchanged, but a batch with such rows overlaps less; greedy and plain temperature sampling never
take that path.
"""

from __future__ import annotations

from inference.scheduling.kv_cache import KVCacheManager
from inference.scheduling.scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus


class StepOverlap:
    """Decides whether the step after a launched one may be launched before its tokens are read,
    and plans that step (reserving its pages)."""

    def __init__(self, scheduler: Scheduler, cache: KVCacheManager, max_model_len: int):
        self.scheduler = scheduler
        self.cache = cache
        self.max_model_len = max_model_len

    @staticmethod
    def _samples_plainly(seq: Sequence, num_new: int) -> bool:
        """Whether the launched step's `num_new` tokens of `seq` reach its end (it samples the
        next token there), without penalties."""
        p = seq.sampling
        return seq.num_tokens - seq.num_computed == num_new and not (p.frequency_penalty or p.presence_penalty)

    def next_batch(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch` (launched, tokens not applied yet), its pages reserved;
        None when the synchronous scheduler must plan it once `batch`'s tokens are known. `batch`
        may hold prompts (requests joining the running ones): those that end there decode next."""
        s = self.scheduler
        if any(batch.num_draft):
            return None
        if s.waiting and len(s.running) < s.max_num_seqs:
            return None  # a new request may join: the scheduler admits it
        in_batch = {id(seq) for seq in batch.seqs}
        if any(id(seq) not in in_batch for seq in s.running):
            return None  # a running sequence sat this step out (its prefill chunk waits for the cap)
        # Sequences that ended (or were aborted) before `batch` could be read have no next step.
        entries = [(seq, n) for seq, n in zip(batch.seqs, batch.num_new) if seq.status == SequenceStatus.RUNNING]
        if not all(self._samples_plainly(seq, n) for seq, n in entries):
            return None  # a prompt chunk short of its end: the scheduler plans the next chunk
        entries = [(seq, n) for seq, n in entries if not self._ends_now(seq)]
        if not entries or len(entries) > s.max_num_batched_tokens:
            return None
        for seq, n in entries:  # `batch` writes positions up to num_computed + n - 1; the next step the one after
            start = seq.num_computed + n
            if self.cache.fit_tokens(seq.pages, start, 1) < 1:
                return None  # out of pages: the scheduler preempts, or parks, as it sees fit
            self.cache.reserve(seq.pages, start, 1)
        return ScheduledBatch([seq for seq, _ in entries], [1] * len(entries), [0] * len(entries))

    def _ends_now(self, seq: Sequence) -> bool:
        """Whether the token the launched step samples for `seq` is its last by length."""
        return seq.num_output_tokens + 1 >= seq.sampling.max_tokens or seq.num_tokens + 1 >= self.max_model_len
