"""Greedy tokens under tensor parallelism without gathering the vocabulary.

Each rank holds the logits of its slice of the vocabulary ([T, V/N]: 50k columns a row at N = 4).
Gathering them all for rank 0 to sample moves T x V values (a 25 MB all-gather at batch 64, bf16)
through every step. A greedy row needs only its argmax: each rank takes the best of its slice
(`argmax_rows`: the first index of the maximum) and its value, and one all-reduce of T x N x 2
floats gives every rank every candidate (`TensorParallelGroup.combine_argmax`, which keeps the
lowest rank's on a tie: the same first index of the maximum that argmax over the whole row
gives). Steps that sample, want logprobs, bias or penalise logits, or verify drafts still gather
(`ModelRunner.plan` decides, `StepPlan.greedy`). Nothing here syncs with the host, so it runs
inside the decode CUDA graphs.
"""

from __future__ import annotations

import torch

from inference.sample.argmax_triton import argmax_rows


def vocab_parallel_argmax(tp, shard: torch.Tensor) -> torch.Tensor:
    """shard: this rank's logits [T, vocab_per_rank] (padding columns past the vocabulary are
    left out) -> the greedy token ids [T] int64, the same on every rank of `tp` (a collective)."""
    start, stop = tp.layout.vocab
    real = shard[:, : stop - start]
    local = argmax_rows(real)
    value = real.gather(1, local[:, None]).squeeze(1).float()
    value = torch.where(torch.isnan(value), torch.full_like(value, float("inf")), value)  # as argmax_rows reads NaN
    return tp.combine_argmax(value, local)
