"""What tokenizing a text costs beyond the linear: its long runs of one character class.

The tokenizer's byte-pair merge takes time quadratic in the length of each piece its regex cuts
the text into. Ordinary text makes short pieces, but a run of letters, of punctuation or of white
space is one piece however long: 32,000 'x' took 0.48 s and 64,000 bytes of 'e' with an accent
1.5 s (openai-harmony 0.0.8, one CPU core), about 4.7e-10 s times the square of the piece's
bytes, holding the GIL and so the whole server. Requests whose text would cost more than
MAX_TOKENIZATION_COST are refused (`request_parsing`); tool output that would is cut short
(`fit_tokenization_budget`).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterator

MAX_TOKENIZATION_COST = 24_000**2  # squared UTF-8 bytes: about 0.27 s of tokenizing
MIN_RUN = 32  # shorter runs are ordinary text, linear in cost


def _marks() -> str:
    """A regex character class body of the combining marks (Unicode category M), which Python's
    `re` cannot name: they join the tokenizer's letter pieces and its punctuation pieces alike."""
    ranges: list[tuple[int, int]] = []
    for cp in [*range(0x20000), *range(0xE0000, 0xE1000)]:  # where the marks are
        if unicodedata.category(chr(cp))[0] == "M":
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


# Runs of letters with marks, of punctuation (marks included: Python's \W holds them), of white
# space. A mark may count in two runs.
_RUNS = [re.compile(rf"(?:[^\W\d_]|[{_marks()}])+"), re.compile(r"(?:[^\w\s]|_)+"), re.compile(r"\s+")]


def _ascii_classes() -> bytes:
    """A `bytes.translate` table: each ASCII byte -> its class in `_RUNS` (L, P, S; D digits;
    ASCII has no marks)."""
    table = bytearray(128)
    for c in range(128):
        ch = chr(c)
        table[c] = ord("L" if ch.isalpha() else "D" if ch.isdigit() else "S" if ch.isspace() else "P")
    return bytes(table) + b"P" * 128


_ASCII_CLASSES = _ascii_classes()
_ASCII_RUN_END = {c: re.compile(b"[^" + bytes([c]) + b"]") for c in b"LPS"}


def long_runs(text: str) -> Iterator[tuple[int, int, int]]:
    """(start, stop, UTF-8 bytes) of each run of MIN_RUN or more letters, punctuation or
    white-space characters, about as long as the tokenizer's piece there (a punctuation piece
    also takes the line breaks after it; a letter piece breaks where lower case turns upper).
    Not in order of position."""
    if len(text) < MIN_RUN:
        return
    if not text.isascii():
        for runs in _RUNS:
            for m in runs.finditer(text):
                if m.end() - m.start() >= MIN_RUN:
                    yield m.start(), m.end(), len(m.group().encode("utf-8", "surrogatepass"))
        return
    # The same for ASCII at C speed (about 30 times faster): each class's long runs found as
    # substrings of the text's class letters.
    classes = text.encode("ascii").translate(_ASCII_CLASSES)
    for c, run_end in _ASCII_RUN_END.items():
        probe = bytes([c]) * MIN_RUN
        start = classes.find(probe)
        while start >= 0:
            end = run_end.search(classes, start)
            stop = end.start() if end else len(classes)
            yield start, stop, stop - start
            start = classes.find(probe, stop)


def tokenization_cost(text: str) -> int:
    """An estimate of the quadratic part of tokenizing `text`, in squared bytes: the sum of its
    long runs' squared UTF-8 lengths."""
    return sum(size**2 for _, _, size in long_runs(text))


def fit_tokenization_budget(text: str, budget: int = MAX_TOKENIZATION_COST) -> str:
    """`text`, or where its runs cost more than `budget`, its part before the run that crosses
    it, with a note of what was left out."""
    cost = 0
    for start, stop, size in sorted(long_runs(text)):
        cost += size**2
        if cost > budget:
            return (
                text[:start] + f"\n[... {len(text) - start} characters left out: a run of {stop - start} "
                "characters with no word boundary is too long to tokenize]"
            )
    return text
