"""Which bit layouts of the MXFP4 expert weights make the decode GEMVs' unpacking cheaper, and what
they cost the grouped (prefill) path, which reads the same bytes.

    python3 experiments/decode_bit_layouts.py [--max-gemv 10]

The decode GEMVs unpack a 32-bit word (8 e2m1 values) into 4 fp16x2 registers: each value's
sign at bit 15 of its half and its 3 magnitude bits at 9-11 (e2m1 * 2^-14), the two halves of a
register from the word's two 16-bit halves. The grouped GEMMs unpack 16 bits (the 4 values of 2
bytes) into 2 bf16x2 registers (sign at 15, magnitude at 6-8). Any layout reachable by permuting
bits within each 16-bit half, the same way in both halves, keeps both readers' loads as they
are. This script counts, per layout, the integer instructions each unpacking needs under a
cost model of the sequences the kernels can use (`_WORD_DECODE_PTX`, `GROUPED_DEQUANT_PTX`):
  GEMV register from one value slot: AND (1); a left shift, AND (2); AND, one multiply making two
  non-overlapping shifted copies, AND (3); AND, right shift, left shift, OR+AND (4);
  grouped register from two value slots of the 16 bits, after an optional byte permute (PRMT)
  shared by both registers: AND (1); shift, AND (2); AND, multiply, AND (3); and two shifted
  copies ORed and masked in one LOP3 where neither copy has data at the other's targets (1-3).
It then checks by exhaustive simulation that the cheapest GEMV layout's sequence unpacks every
16-bit pattern to the right fp16 bits. docs/benchmark-log.md ("A cheaper MXFP4 unpacking") has the result.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

FP16 = (9, 10, 11, 15)  # target bits of a value's (mantissa, exponent 0, exponent 1, sign) in a half
BF16 = (6, 7, 8, 15)
M32 = 0xFFFFFFFF


def gemv_cost(pos: tuple[int, ...]) -> int:
    """Instructions that unpack one value slot (its bit positions `pos` in each 16-bit half) into
    an fp16x2 register; 99 if no sequence of the model does it."""
    shifts = [t - p for t, p in zip(FP16, pos)]
    distinct = sorted(set(shifts))
    if distinct == [0]:
        return 1
    if len(distinct) == 1:
        return 2 if distinct[0] > 0 else 99  # a right shift would pull the sign from the other half
    if len(distinct) > 2:
        return 99
    src = set(pos) | {p + 16 for p in pos}
    a, b = ({(q + d) % 64 for q in src} for d in distinct)
    if a & b:
        return 99  # the copies would carry into each other
    return 3 if distinct[0] >= 0 else 4


@functools.lru_cache(maxsize=None)
def _pair_cost(x: tuple, y: tuple, data: frozenset, target: tuple[int, ...]) -> int:
    """Instructions that move value x (candidate positions of each bit in a 32-bit register whose
    bits `data` hold data, the rest zero) to the low half's `target` bits and y to the high
    half's, all other bits zero."""
    best = 99
    for cx in itertools.product(*x):
        for cy in itertools.product(*y):
            sx = {t - p for t, p in zip(target, cx)}
            sy = {t + 16 - p for t, p in zip(target, cy)}
            distinct = sorted(sx | sy)
            if len(distinct) == 1:
                best = min(best, 1 if distinct[0] == 0 else 2)  # (shift,) AND
                continue
            if min(distinct) >= 0:
                src = set(cx) | set(cy)
                copies = [{q + d for q in src if q + d < 32} for d in distinct]
                if all(not (c & d) for c, d in itertools.combinations(copies, 2)):
                    best = min(best, 3)  # AND, one multiply with a term per shift, AND
            if len(sx) == 1 and len(sy) == 1:
                # (r << a) | (r << b) masked in one LOP3 (negative: right shifts), where the other
                # copy holds no data at the targets
                (a,), (b,) = sx, sy
                if all(t - b not in data for t in target) and all(t + 16 - a not in data for t in target):
                    best = min(best, 1 + (a != 0) + (b != 0))
    return best


def grouped_cost(slots: list[tuple[int, ...]], target: tuple[int, ...] = BF16) -> int:
    """Instructions that unpack the 16 bits into two registers: the best pairing of the 4 value
    slots, after the best byte permute (counted 1, unless it is the identity). Any pairing counts,
    so this is a lower bound: the shipped kernels pair K-adjacent values of one scale block, and
    another pairing would also need the activations permuted to match."""
    best = 99
    for sel in itertools.product((0, 1, None), repeat=4):  # source byte of each output byte
        permute = 0 if sel == (0, 1, None, None) else 1

        data = frozenset(8 * k + i for k, s in enumerate(sel) if s is not None for i in range(8))

        def where(pos):
            return tuple(tuple(8 * k + p % 8 for k, s in enumerate(sel) if s == p // 8) for p in pos)

        for a, b, c, d in itertools.permutations(range(4)):
            if a > c:
                continue
            cost = permute
            for lo, hi in ((slots[a], slots[b]), (slots[c], slots[d])):
                x, y = where(lo), where(hi)
                cost += 99 if any(not w for w in x + y) else _pair_cost(x, y, data, target)
            best = min(best, cost)
    return best


def current_layout() -> list[tuple[int, ...]]:
    """The shipped layout's value slots in a 16-bit half (`planar_tiles`: per byte, the low
    value's sign at bit 0 and magnitude at 1-3, the high value's at 4 and 5-7)."""
    return [(1, 2, 3, 0), (9, 10, 11, 8), (5, 6, 7, 4), (13, 14, 15, 12)]


def layouts(max_gemv: int):
    """Every split of a half's 16 bits into 4 value slots whose GEMV cost is at most max_gemv."""
    slots = [p for p in itertools.permutations(range(16), 4) if gemv_cost(p) <= 4]
    by_set: dict[frozenset, list] = {}
    for p in slots:
        by_set.setdefault(frozenset(p), []).append(p)
    keys = list(by_set)
    for combo in itertools.combinations(keys, 4):
        if len(frozenset().union(*combo)) != 16:
            continue
        for choice in itertools.product(*(by_set[k] for k in combo)):
            cost = sum(gemv_cost(p) for p in choice)
            if cost <= max_gemv:
                yield cost, list(choice)


def simulate_gemv(slots: list[tuple[int, ...]]) -> None:
    """Unpack every 16-bit pattern (in both halves) with each slot's cheapest sequence and compare
    with the fp16 bits the slot's value must become."""
    for pos in slots:
        shifts = sorted(set(t - p for t, p in zip(FP16, pos)))
        if min(shifts) < 0 or len(shifts) > 2:
            raise ValueError(f"slot {pos}: only AND, shift-AND and multiply sequences are simulated")
        mask = 0x8E008E00
        src = sum(1 << p for p in pos) * 0x10001  # the slot's bits in both halves
        for half in range(1 << 16):
            w = half | (((half * 0x9E37) & 0xFFFF) << 16)  # a different pattern in the high half
            if len(shifts) == 1:
                got = ((w << shifts[0]) & M32) & mask
            else:
                got = (((w & src) * ((1 << shifts[0]) + (1 << shifts[1]))) & M32) & mask
            want = 0
            for h in range(2):
                for t, p in zip(FP16, pos):
                    want |= ((w >> (16 * h + p)) & 1) << (16 * h + t)
            assert got == want, (pos, hex(w), hex(got), hex(want))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-gemv", type=int, default=10, help="largest GEMV cost a word to search")
    args = ap.parse_args()
    cur = current_layout()
    print(
        f"shipped layout: GEMV {sum(gemv_cost(p) for p in cur)} instructions a word, "
        f"grouped {grouped_cost(cur)} a 16 bits (bf16)"
    )
    t0 = time.time()
    best: dict[int, tuple] = {}  # GEMV cost -> (least bf16 grouped cost, least fp16 one, a layout)
    for cost, slots in layouts(args.max_gemv):
        g_bf16, g_fp16 = grouped_cost(slots), grouped_cost(slots, FP16)
        old = best.get(cost, (99, 99, slots))
        # the layout shown is the best for bf16 operands (the shipped kind), ties broken by fp16
        shown = slots if (g_bf16, g_fp16) < old[:2] else old[2]
        best[cost] = (min(g_bf16, old[0]), min(g_fp16, old[1]), shown)

    def show(g: int) -> str:
        return "none" if g >= 99 else str(g)

    print(
        f"searched in {time.time() - t0:.0f} s\n\n| GEMV a word | least grouped, bf16 | least grouped, fp16 | "
        "a layout: slots (m, e0, e1, s) |"
    )
    print("| ---: | ---: | ---: | --- |")
    for cost in sorted(best):
        g_bf16, g_fp16, slots = best[cost]
        print(f"| {cost} | {show(g_bf16)} | {show(g_fp16)} | {slots} |")
    cheapest = best[min(best)][2]
    simulate_gemv(cheapest)
    print(f"\nsimulated: the {min(best)}-instruction layout unpacks all 65,536 half-words correctly")


if __name__ == "__main__":
    main()
