"""Speculative decoding: the drafter interface (`make_drafter` in `drafters.py` picks one).

Batch-1 decode reads every weight once per token, so it is bound by memory bandwidth; checking
k guessed tokens in one step costs about as much as generating one. Each engine step then:

  1. the scheduler gives a decoding sequence 1 + k tokens: its last token and its drafts;
  2. the target runs them as one extend step (attention over cached + new keys) and returns
     logits for every position; `RejectionSampler.verify` keeps a prefix of the drafts and adds
     one token of its own, so the output is exactly what plain decoding would produce (greedy)
     or follow the same distribution (sampling);
  3. the engine appends those tokens and rolls the KV cache back to them (pages that only held
     rejected drafts are freed), then asks the drafter for the next drafts.

Drafters (one module each):
  * "ngram" (`inference/spec_decode/ngram.py`): prompt lookup, no extra weights; suits agent
    traffic that quotes tool output and earlier text.
  * "eagle3" (`inference/spec_decode/eagle3.py`): an EAGLE-3 draft head reading three of the target's
    layer outputs; needs a draft checkpoint (`draft_model`).

Seeds: with speculation a seeded sequence still follows the same distribution, but its exact
tokens can depend on the rest of the batch: the scheduler trims drafts to the step's token
budget and free pages, which changes how many random draws a step takes. Without speculation
the same seed gives the same tokens whatever else runs (`inference/sample/sampler.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from inference.scheduling.scheduler import Sequence


@dataclass
class DraftContext:
    """What one target step leaves for the drafter; lists are per batch entry, in batch order.

    start:      position of the entry's first row (its num_computed before the step)
    num_kept:   how many of its rows stay in the KV cache (tokens that were not drafts, plus the
                drafts that were kept); the token after each kept row is now in seq.token_ids
    first_row:  the entry's first row in the step's flat batch (indexes `aux_hidden`)
    limit:      how many drafts to propose for it (0: none: finished, or mid-prefill)
    aux_hidden: [T, A] the target layer outputs the drafter asked for, or None
    """

    seqs: list[Sequence]
    start: list[int]
    num_kept: list[int]
    first_row: list[int]
    limit: list[int]
    aux_hidden: torch.Tensor | None = None


class Drafter(Protocol):
    # Target layers whose outputs `propose` reads (the model runner returns them each step).
    aux_layers: tuple[int, ...]
    # True when `propose` writes K/V of its own at the positions it drafts for: the engine then
    # reserves the next step's pages before asking.
    writes_ahead: bool

    def kv_bytes_per_page(self, page_size: int) -> int:
        """Bytes of the drafter's own K/V per full-pool page (0 when it keeps none)."""
        ...

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        """Make the drafter's own K/V pages, indexed by the sequences' full-attention page tables."""
        ...

    def propose(self, ctx: DraftContext) -> list[list[int]]:
        """Draft tokens for each entry, at most ctx.limit[i] each (fewer or none is fine)."""
        ...
