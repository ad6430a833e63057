"""Grammar masks on the device: the rows of a step's logits that a grammar constrains, and to what.

A constrained request's `GrammarMatcher` (`inference/grammar.py`) writes its allowed next tokens as
a bitmask on the host, into a pinned staging buffer; one non-blocking copy takes the step's masks
to the device, where the sampler sets every disallowed token's logit to -inf in those rows only
(after logit bias and penalties, before temperature and truncation). Rows without a grammar are
not touched, and a step without one builds nothing.

With speculative decoding a constrained sequence's k drafts get k + 1 rows: the tokens allowed
after each prefix of its drafts (`GrammarMatcher.fill_masks_for_drafts`), so the rejection
sampler keeps only drafts the grammar allows and draws every replacement from allowed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.grammar import GrammarMatcher
from inference.transfers import StagingBuffers, to_device


@dataclass
class TokenMasks:
    """Masks for some rows of a [N, V] logits tensor."""

    rows: list[int]  # which rows, ascending
    bits: torch.Tensor  # [len(rows), ceil(V / 32)] int32 on the logits' device: bit t % 32 of word t // 32


@dataclass
class MaskedEntry:
    """One constrained entry of a step: its first logits row, its matcher, and the drafts it
    verifies (its rows are first_row .. first_row + len(drafts))."""

    first_row: int
    matcher: GrammarMatcher
    drafts: tuple[int, ...] = ()


class TokenMaskBuilder:
    """Fills a step's masks on the host and sends them to the device in one copy."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # A buffer is written again two steps later, after that step's tokens were read (which
        # come after the copy out of it on the stream), so the copy never waits in practice.
        self.staging = StagingBuffers(self.device, count=2)

    def build(self, entries: list[MaskedEntry]) -> TokenMasks | None:
        if not entries:
            return None
        words = entries[0].matcher.words
        rows = [e.first_row + i for e in entries for i in range(len(e.drafts) + 1)]
        nbytes = len(rows) * words * 4
        host = self.staging.take(nbytes).view(np.int32).reshape(len(rows), words)
        at = 0
        for e in entries:
            n = len(e.drafts) + 1
            block = host[at : at + n]
            if e.drafts:
                e.matcher.fill_masks_for_drafts(list(e.drafts), block)
            else:
                e.matcher.fill_mask(block[0])
            # A row that allows nothing is left free: after drafts that complete the grammar (the
            # request ends at the last one, that row is never used), or a matcher in an error
            # state (the engine ends the request when its grammar refuses the token).
            block[~block.any(axis=1)] = -1
            at += n
        bits = self.staging.send(nbytes).view(torch.int32).view(len(rows), words)
        return TokenMasks(rows, bits)


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """[32] int32: 1 << k (bit 31 as int32's sign bit), on `device`."""
    if device not in _BIT_VALUES:
        _BIT_VALUES[device] = to_device([1 << k for k in range(31)] + [-(1 << 31)], torch.int32, device)
    return _BIT_VALUES[device]


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks | None, inplace: bool = False) -> torch.Tensor:
    """`logits` [N, V] with every token a row's mask disallows at -inf (a copy unless `inplace`)."""
    if masks is None:
        return logits
    vocab = logits.shape[-1]
    allowed = ((masks.bits.unsqueeze(-1) & _bit_values(logits.device)) != 0).view(len(masks.rows), -1)[:, :vocab]
    if len(masks.rows) == logits.shape[0]:  # rows are ascending and distinct: every row
        return torch.where(allowed, logits, float("-inf"))
    out = logits if inplace else logits.clone()
    rows = to_device(masks.rows, torch.long, logits.device)
    out[rows] = torch.where(allowed, out[rows], float("-inf"))
    return out
