"""Async scheduling: launch step N+1 before reading step N's tokens back.

A synchronous step leaves the device idle while the host reads the sampled ids, applies them
(stop checks, prefix-cache registration, deltas) and plans and prepares the next step. The next
step is known in advance except for the tokens step N samples: every sequence step N samples
decodes one more token, one position further on; a prompt's next chunk and a waiting request's
first chunk need nothing from step N at all. So the engine plans step N+1 as the scheduler would
once step N is applied (`Scheduler.schedule_after`), launches it right after step N, with step
N's sampled ids as the inputs of its decode rows taken on the device (`ModelRunner.launch(...,
after=)`), and only then reads step N's ids; the host work of step N overlaps step N+1 on the
device. (vLLM's async scheduling and SGLang's overlap scheduler work the same way.) A prompt
joining a busy batch costs its streams the prompt's step and no more: before, the steps where
prompts joined were planned synchronously, and at 256 streams of 20b that was 6 of every 37 ms
such a step took (docs/benchmark-log.md, "Steps where prompts join, planned ahead").

What a follow-up step can get wrong is only known when step N's tokens arrive; it is handled then:
  * a sequence that stops at step N (a stop token) has a surplus row in step N+1: the engine
    drops that row (the sequence is no longer running) and frees the pages as usual. The surplus
    row writes K/V one position past the end, into a page only that sequence held; the device
    runs it before any later step that could reuse the page.
  * a sequence that will reach max_tokens or the context length at step N is known in advance
    and left out of step N+1.
What step N changes for planning is allowed for: its prompt pages are registered for prefix
sharing only when it is applied, so a waiting request that would find more of its prompt cached
then waits one step (`Scheduler._prefix_grows_in_flight`), and the sliding-window pages step N
fills are not freed before they are registered (`KVCacheManager.reserve(..., ahead=True)`).
Everything else falls back to the scheduler's plan once the tokens are read (`next_batch`
None): drafts, penalties (the sampler needs the token history on the host), pages that do not
fit (only the synchronous scheduler preempts). The engine does not build this at all with a
drafter or under tensor parallelism.

One cost stays hidden in a launch: when a row truncates by top-k/top-p and the sampler's cheap
check cannot prove its candidates hold the kept set, it reads one flag from the device
(`inference/sample/sampler.py`, `_top_k_top_p`), which waits for the step just launched. The output is
unchanged, but a batch with such rows overlaps less; greedy and plain temperature sampling never
take that path.
"""

from __future__ import annotations

from inference.scheduling.scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus


class StepOverlap:
    """Decides whether the step after a launched one may be launched before its tokens are read,
    and plans that step (reserving its pages)."""

    def __init__(self, scheduler: Scheduler, max_model_len: int):
        self.scheduler = scheduler
        self.max_model_len = max_model_len

    def next_batch(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step after `batch` (launched, tokens not applied yet), planned by the scheduler as
        if `batch` were applied (`Scheduler.schedule_after`), its pages reserved; None when the
        synchronous scheduler must plan it once `batch`'s tokens are known."""
        if any(batch.num_draft):
            return None
        inflight: dict[Sequence, int] = {}
        ending: set[Sequence] = set()
        # Sequences that ended (or were aborted) before `batch` could be read have no next step.
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.status != SequenceStatus.RUNNING:
                continue
            inflight[seq] = n
            if seq.num_computed + n == seq.num_tokens:  # `batch` samples its next token
                p = seq.sampling
                if p.frequency_penalty or p.presence_penalty:
                    return None  # the sampler needs the token history on the host
                if self._ends_now(seq):
                    ending.add(seq)
        if not inflight:
            return None
        return self.scheduler.schedule_after(inflight, frozenset(ending))

    def _ends_now(self, seq: Sequence) -> bool:
        """Whether the token the launched step samples for `seq` is its last by length."""
        return seq.num_output_tokens + 1 >= seq.sampling.max_tokens or seq.num_tokens + 1 >= self.max_model_len
