"""The n-gram (prompt lookup) drafter: guess that text repeats.

Take the sequence's last n tokens (n from `max_n` down to `min_n`), find their most recent
earlier occurrence in the sequence (prompt and output), and propose the tokens that followed it.
An occurrence followed by a full `limit` tokens is preferred; when the only match is followed by
fewer (a period shorter than the draft), the lookup repeats on the text extended by the guess,
which continues the period. No weights, no GPU work: a fit for agents that quote tool output,
code they edit, or their own earlier words.

Search runs in C: a sequence's tokens are kept as int32 bytes (extended incrementally) and the
n-gram is found with `bytes.rfind`, keeping only 4-byte-aligned hits.
"""

from __future__ import annotations

import weakref
from array import array

from inference.scheduling.scheduler import Sequence
from inference.spec_decode.drafter import DraftContext


class NgramDrafter:
    aux_layers: tuple[int, ...] = ()
    writes_ahead = False

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: weakref.WeakKeyDictionary[Sequence, array] = weakref.WeakKeyDictionary()

    def kv_bytes_per_page(self, page_size: int) -> int:
        return 0

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        pass

    def propose(self, ctx: DraftContext) -> list[list[int]]:
        return [self.draft(seq, limit) if limit > 0 else [] for seq, limit in zip(ctx.seqs, ctx.limit)]

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` tokens guessed to follow seq.token_ids."""
        tokens = self._tokens.get(seq)
        if tokens is None or len(tokens) > seq.num_tokens:
            tokens = self._tokens[seq] = array("i")
        tokens.extend(seq.token_ids[len(tokens) :])
        text = tokens.tobytes()
        out: list[int] = []
        while len(out) < limit:
            guess = lookup(text, limit - len(out), self.min_n, self.max_n)
            if not guess:
                break
            out.extend(guess)
            text += array("i", guess).tobytes()
        return out


def lookup(text: bytes, limit: int, min_n: int, max_n: int) -> list[int]:
    """Tokens (int32 bytes `text`) that followed the latest earlier occurrence of its last n tokens,
    for the largest n in [min_n, max_n] that occurs; up to `limit` of them, preferring an
    occurrence with `limit` tokens after it. Empty when no suffix recurs."""
    length = len(text) // 4
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = text[-4 * n :]
        # First an occurrence with a full `limit` tokens after it, else any earlier one.
        for end in (length - limit, length - 1):
            start = _rfind_aligned(text, pattern, 4 * end)
            if start is not None:
                follow = start // 4 + n
                return array("i", text[4 * follow : 4 * min(follow + limit, length)]).tolist()
    return []


def _rfind_aligned(text: bytes, pattern: bytes, end: int) -> int | None:
    """Byte offset of the last 4-byte-aligned occurrence of `pattern` ending at or before `end`."""
    while end >= len(pattern):
        pos = text.rfind(pattern, 0, end)
        if pos < 0:
            return None
        if pos % 4 == 0:
            return pos
        end = pos + len(pattern) - 1  # skip this misaligned hit
    return None
