"""Triton sink attention over the paged KV cache (layout and math: `inference/ops/attention/reference.py`).

Two launches cover every step:

* decode (every sequence has exactly one new token): grid (sequence, KV head, split). One
  program holds the G query heads of its KV group as the rows of one tile (GQA packing), so each
  K/V page is read once for all of them. Long contexts are cut into `num_splits` chunks
  (flash-decoding); each split writes an unnormalised partial output with its running max and
  sum, and `_combine_kernel` merges the splits together with the sink logit.
  `decode_attention_with_new_kv` also folds in the step's RoPE and K/V cache write (otherwise
  `rope_cache`'s own launch): each program rotates q and the new key and takes the key into its
  softmax masked, so that only the split owning the newest position counts it; that split also
  stores the new key and value in the cache.
* prefill/extend (a ragged batch of new tokens over cached plus new keys, causal): grid (query
  tile, KV head). A tile is BLOCK_T consecutive new tokens of one sequence times the G heads of
  one KV group, again packed as rows, so K/V blocks are shared by the group. Each program finds
  its sequence from `cu_seqlens_q` itself, so the host builds no tile list (no copy, no sync).

The cache holds the model's dtype or float8 e4m3 (`EngineConfig.kv_cache_dtype`); an fp8 cache's
keys and values are widened to fp16 as they are loaded (`_mma_operand`), and the decode kernel's
new key and value are saturated and rounded to fp8 before they join the softmax, so that this
step sees what later steps read back.

Both walk keys in blocks of BLOCK_N positions, look up each position's physical page in the
block table, and only ever touch positions a query may see: [0, pos] on full layers,
(pos - window, pos] on sliding ones. Freed pages (-1) lie outside every window, so they are never
loaded. Softmax runs online in base 2 (scores pre-multiplied by log2 e); a non-split program
starts its running max at the sink logit and its sum at 1, which both counts the sink exactly
once and keeps fully masked blocks from producing NaN.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference.ops.attention.reference import FP8_KV_DTYPE, AttentionMetadata, leading_decode_rows
from inference.ops.attention.rope_cache import as_cached, to_cache_dtype
from inference.ops.dependent_launch import pdl_options, wait_for_previous
from inference.ops.multiprocessors import multiprocessors

LOG2E = 1.4426950408889634


@triton.jit
def _attend_blocks(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    block_table_row,
    kv_head_offset,
    start,
    end,
    q_pos,
    window,
    qk_scale,
    stride_page,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """Fold keys [start, end) into the running softmax state of the rows of `q` [M, D]. Keys and
    values are converted to q's dtype as they are loaded (an fp8 cache's to fp16, `_mma_operand`).

    Without MASKED every key in [start, end) must be visible to every row and `end - start` must
    be a multiple of BLOCK_N (no bounds checks at all); with MASKED, keys past `end`, after a
    row's position, or (SLIDING) at or before `q_pos - window` are dropped.
    """
    dims = tl.arange(0, HEAD_DIM)
    for block_start in range(start, end, BLOCK_N):
        k_pos = block_start + tl.arange(0, BLOCK_N)
        if MASKED:
            in_range = k_pos < end
            page = tl.load(block_table_row + k_pos // PAGE_SIZE, mask=in_range, other=0)
        else:
            page = tl.load(block_table_row + k_pos // PAGE_SIZE)
        offsets = page.to(tl.int64) * stride_page + (k_pos % PAGE_SIZE) * stride_slot + kv_head_offset
        ptrs = offsets[:, None] + dims[None, :]
        if MASKED:
            k = tl.load(K + ptrs, mask=in_range[:, None], other=0.0).to(q.dtype)
        else:
            k = tl.load(K + ptrs).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            visible = in_range[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V + ptrs, mask=in_range[:, None], other=0.0).to(q.dtype)
        else:
            v = tl.load(V + ptrs).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _mma_operand(q, K, KV_FP8: tl.constexpr):
    """q as the attention MMAs take it: in the cache's dtype, or for an fp8 cache (KV_FP8) in
    fp16, which e4m3 widens to in one instruction a pair; q is clipped to fp16's range there."""
    if KV_FP8:
        operand = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        operand = q.to(K.dtype.element_ty)
    return operand


@triton.jit
def _rope_factors(CosSin, pos, stride_cos, dims, HALF: tl.constexpr):
    """(cos, signed sin) of position pos for head dims `dims`, float32 (see `_half_pair`)."""
    cos = tl.load(CosSin + pos * stride_cos + dims % HALF).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cos + HALF + dims % HALF).to(tl.float32)
    return cos, tl.where(dims < HALF, -sin, sin)


@triton.jit
def _half_pair(ptr, dims, mask, HALF: tl.constexpr):
    """Head vectors at ptr + dims ([..., D] pointers) and their "rotate half" partners, float32:
    RoPE is x * cos + partner * signed_sin, where the partner of dim d is d + HALF for the first
    half (signed_sin = -sin there) and d - HALF for the second (+sin)."""
    x = tl.load(ptr + dims, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptr + (dims + HALF) % (2 * HALF), mask=mask, other=0.0).to(tl.float32)
    return x, partner


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Sinks,
    BlockTables,
    ContextLens,
    Out,
    PartAcc,
    PartMax,
    PartSum,
    KNew,
    VNew,
    Positions,
    CosSin,
    Slots,
    stride_qt,
    stride_qh,
    stride_page,
    stride_slot,
    stride_kv_head,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    qk_scale,
    window,
    num_splits,
    NUM_Q_HEADS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SPLIT: tl.constexpr,
    NEW_KV: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (sequence, KV head, split). With NEW_KV, q is not yet rotated and the step's new key
    and value (KNew, VNew: [B, Hkv, D], the projection's output) are not in the cache yet:
    the program rotates q and k by the token's position (`Positions`, table `CosSin`, as
    `rope_cache` does) and takes the new key into its softmax from registers, masked out unless
    its split ends at the newest position; that program also stores the rotated k and v at the
    token's slot (`Slots`, -1: none). That is the RoPE + cache-write launch folded into
    attention. With NEW_KV every sequence has ctx >= 1 (graph padding included): with none, a
    masked-out new value that is not finite would reach the output. Without it a row of ctx 0
    attends to nothing and writes zeros (a step graph's decode rows past the real ones).

    The loads are ordered for a small batch, which waits on this kernel's chain of round trips
    rather than on its bytes: first all that the program's ids locate (context length, position,
    q, the new key and value), then RoPE's factors, then the cached keys' pages, then the keys.
    The new key joins the softmax first and goes to the cache by a masked store, not under a
    branch: the compiler sinks loads into the branch that uses them, and a store waiting on such
    loads held back every load after it. That took six round trips in series for the split that
    holds the newest position; this order takes four (sm_90 SASS, triton 3.6)."""
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_G)
    row_ok = rows < G
    heads = kv_head * G + rows
    dims = tl.arange(0, HEAD_DIM)
    HALF: tl.constexpr = HEAD_DIM // 2
    # Round trip 1: what the program's ids alone locate.
    ctx = tl.load(ContextLens + seq)
    sink = tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    q_ptrs = Q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    if NEW_KV:
        pos = tl.load(Positions + seq).to(tl.int64)
        q_x, q_partner = _half_pair(q_ptrs, dims[None, :], row_ok[:, None], HALF)
        # The new key and value broadcast over q's rows, the shape the softmax takes them in (a
        # row converted to it would be loaded again, late); row 0 goes to the cache.
        head_row = rows[:, None] * 0 + dims[None, :]  # [BLOCK_G, D] offsets: one head vector per row
        k_ptr = KNew + seq.to(tl.int64) * stride_kt + kv_head * stride_kh
        k_rows_x, k_rows_partner = _half_pair(k_ptr, head_row, dims[None, :] < HEAD_DIM, HALF)
        v_rows = tl.load(VNew + seq.to(tl.int64) * stride_vt + kv_head * stride_vh + head_row)
        slot = tl.load(Slots + seq)
        # All of these are issued here: the compiler moves no load past a barrier, and without
        # one it has issued the new value's load after the wait for RoPE's factors.
        tl.debug_barrier()
    else:
        q = _mma_operand(tl.load(q_ptrs + dims[None, :], mask=row_ok[:, None], other=0.0), K, KV_FP8)

    if SLIDING:
        lo = tl.maximum(ctx - window, 0)
    else:
        lo = ctx * 0
    # Splits cut [lo, ctx) into equal whole-block chunks; trailing splits may get nothing.
    chunk = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, ctx)
    if NEW_KV:
        holds_new = (start < end) & (end == ctx)  # this split owns the newest position, ctx - 1,
        end = tl.where(holds_new, end - 1, end)  # which the cache does not hold yet
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    table = BlockTables + seq.to(tl.int64) * stride_bt
    kv_off = kv_head * stride_kv_head

    if SPLIT:
        m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
    else:
        m_i = sink
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    if NEW_KV:
        # Round trip 2: RoPE's factors (the pages of the cached keys follow, then the keys).
        cos, signed_sin = _rope_factors(CosSin, pos, stride_cos, dims, HALF)
        q = q_x * cos[None, :] + q_partner * signed_sin[None, :]
        q = _mma_operand(q.to(Q.dtype.element_ty), K, KV_FP8)  # rounded like the RoPE kernel's output
        # The new key is visible to the token on every layer kind (it is the token itself). A
        # split that does not hold it masks it out.
        k_rows = (k_rows_x * cos[None, :] + k_rows_partner * signed_sin[None, :]).to(KNew.dtype.element_ty)
        # The new key and value as the cache stores them, and as later steps read them back
        # (float32), which is what this step's softmax takes too.
        k_cached, v_cached = to_cache_dtype(k_rows, K, KV_FP8), to_cache_dtype(v_rows, V, KV_FP8)
        k_rows, v_rows = as_cached(k_rows, K, KV_FP8), as_cached(v_rows, V, KV_FP8)
        s = tl.sum(q.to(tl.float32) * k_rows, axis=1) * qk_scale
        s = tl.where(holds_new, s, float("-inf"))
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_rows
        m_i = m_new
        row = tl.where(holds_new & (slot >= 0), 0, BLOCK_G)  # the row that writes to the cache, if any
        write = (rows[:, None] == row) & (dims[None, :] < HEAD_DIM)
        slot = tl.maximum(slot, 0)
        dst = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot + kv_off
        tl.store(K + dst + head_row, k_cached, mask=write)
        tl.store(V + dst + head_row, v_cached, mask=write)
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + (ctx - 1)
    acc, m_i, l_i = _attend_blocks(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        table,
        kv_off,
        start,
        full_end,
        q_pos,
        window,
        qk_scale,
        stride_page,
        stride_slot,
        PAGE_SIZE,
        BLOCK_N,
        HEAD_DIM,
        False,
        False,
    )
    acc, m_i, l_i = _attend_blocks(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        table,
        kv_off,
        full_end,
        end,
        q_pos,
        window,
        qk_scale,
        stride_page,
        stride_slot,
        PAGE_SIZE,
        BLOCK_N,
        HEAD_DIM,
        True,
        False,
    )
    if SPLIT:
        part = (seq * NUM_Q_HEADS + heads).to(tl.int64) * num_splits + split
        tl.store(PartAcc + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(PartMax + part, m_i, mask=row_ok)
        tl.store(PartSum + part, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(
            Out + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None],
        )


@triton.jit
def _combine_kernel(
    PartAcc,
    PartMax,
    PartSum,
    Sinks,
    Out,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge one (sequence, head)'s split partials; the sink joins the denominator here."""
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    part = (seq * NUM_Q_HEADS + head).to(tl.int64) * num_splits + splits
    m = tl.load(PartMax + part, mask=split_ok, other=-1.0e30)
    s = tl.load(PartSum + part, mask=split_ok, other=0.0)
    sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
    m_all = tl.maximum(tl.max(m, 0), sink)
    w = tl.exp2(m - m_all)
    denom = tl.sum(s * w, 0) + tl.exp2(sink - m_all)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(PartAcc + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(Out + seq.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty))


@triton.jit
def _sequence_tiles(CuSeqlensQ, b0, num_seqs, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    """Tiles of sequences b0 .. b0 + BLOCK_B - 1 ([BLOCK_B] int32; 0 past num_seqs)."""
    b_idx = b0 + tl.arange(0, BLOCK_B)
    b_ok = b_idx < num_seqs
    q_starts = tl.load(CuSeqlensQ + b_idx, mask=b_ok, other=0)
    q_ends = tl.load(CuSeqlensQ + b_idx + 1, mask=b_ok, other=0)
    return (q_ends - q_starts + BLOCK_T - 1) // BLOCK_T


# The counts and the block table's width change from step to step; specialised on (divisible by
# 16, or 1), each new combination compiled a variant while serving (1.5 s stalls, docs/benchmark-log.md).
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(
    Q,
    K,
    V,
    Sinks,
    BlockTables,
    ContextLens,
    CuSeqlensQ,
    Out,
    stride_qt,
    stride_qh,
    stride_page,
    stride_slot,
    stride_kv_head,
    stride_bt,
    stride_ot,
    stride_oh,
    qk_scale,
    window,
    num_seqs,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    BLOCK_B: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Tiles are numbered through the batch, sequence by sequence, and counted here from the
    # sequences' lengths (a CUDA graph's grid only bounds them, see `_prefill`). They run
    # last-first, so that a long prompt's heaviest (latest) tiles start first; programs past
    # the step's tiles come last and return at once.
    num_tiles = 0
    for b0 in range(0, num_seqs, BLOCK_B):
        num_tiles += tl.sum(_sequence_tiles(CuSeqlensQ, b0, num_seqs, BLOCK_T, BLOCK_B), 0)
    tile = num_tiles - 1 - tl.program_id(0)
    if tile < 0:
        return
    kv_head = tl.program_id(1)
    # Find this tile's sequence (no host-side tile list), BLOCK_B sequences at a time: the
    # sequences whose tiles all come before this one.
    seq = 0
    tiles_before = 0  # the tiles of those sequences
    tiles_scanned = 0
    for b0 in range(0, num_seqs, BLOCK_B):
        seq_tiles = _sequence_tiles(CuSeqlensQ, b0, num_seqs, BLOCK_T, BLOCK_B)
        before = tiles_scanned + tl.cumsum(seq_tiles, 0) <= tile
        seq += tl.sum(before.to(tl.int32), 0)
        tiles_before += tl.sum(tl.where(before, seq_tiles, 0), 0)
        tiles_scanned += tl.sum(seq_tiles, 0)
    t0 = (tile - tiles_before) * BLOCK_T  # first token, within the sequence
    q_first = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_first
    ctx = tl.load(ContextLens + seq)
    first_pos = ctx - q_len  # absolute position of the sequence's first new token

    # Row r of the tile is token t0 + r // G_PAD, query head kv_head * G + r % G_PAD.
    rows = tl.arange(0, BLOCK_T * G_PAD)
    tok = t0 + rows // G_PAD
    g = rows % G_PAD
    row_ok = (tok < q_len) & (g < G)
    heads = kv_head * G + g
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = (q_first + tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = _mma_operand(tl.load(Q + q_ptrs, mask=row_ok[:, None], other=0.0), K, KV_FP8)
    q_pos = first_pos + tok

    sink = tl.load(Sinks + heads, mask=g < G, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = sink
    l_i = tl.full([BLOCK_T * G_PAD], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_T * G_PAD, HEAD_DIM], tl.float32)

    tile_first = first_pos + t0
    hi = tl.minimum(tile_first + BLOCK_T, ctx)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    kv_off = kv_head * stride_kv_head
    if SLIDING:
        # The window's edge moves with every row, so every block is masked (at most
        # (window + BLOCK_T) / BLOCK_N of them).
        lo = tl.maximum(tile_first - window + 1, 0)
        acc, m_i, l_i = _attend_blocks(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            table,
            kv_off,
            lo,
            hi,
            q_pos,
            window,
            qk_scale,
            stride_page,
            stride_slot,
            PAGE_SIZE,
            BLOCK_N,
            HEAD_DIM,
            True,
            True,
        )
    else:
        # Keys before the tile's first token are visible to all its rows: unmasked whole blocks.
        full_end = tile_first // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_blocks(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            table,
            kv_off,
            0,
            full_end,
            q_pos,
            window,
            qk_scale,
            stride_page,
            stride_slot,
            PAGE_SIZE,
            BLOCK_N,
            HEAD_DIM,
            False,
            False,
        )
        acc, m_i, l_i = _attend_blocks(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            table,
            kv_off,
            full_end,
            hi,
            q_pos,
            window,
            qk_scale,
            stride_page,
            stride_slot,
            PAGE_SIZE,
            BLOCK_N,
            HEAD_DIM,
            True,
            False,
        )
    out = acc / l_i[:, None]
    o_ptrs = (q_first + tok).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(Out + o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel; None = pick from the batch and context.

    block_n: keys per loop step: 64 while the grid (splits included) has at most `waves`
    programs a multiprocessor, 32 past that (an H200 sweep, docs/benchmark-log.md: at 64 sequences
    x 1k keys one split of 64-key steps takes 40.6 us against 45.7 for two of 32-key steps; at
    128 sequences, 1024 programs, 32-key steps win), and 64 again in 2-warp programs past
    `wide_waves` (`decode_num_warps`).
    """

    block_n: int | None = None
    num_warps: int | None = None  # None: 4, or 2 past `wide_waves`
    num_stages: int = 3
    num_splits: int | None = None
    min_chunk: int = 256  # fewest keys worth splitting (a split costs a combine launch)
    split_keys: int = 64  # fewest keys a split gets once splitting
    waves: float = 4.0  # at most this many programs per multiprocessor (splits and block_n)
    # Past this many programs a multiprocessor (serving batches: 256 sequences x 8 KV heads is
    # 15.5 on an H200), 64-key steps in 2-warp programs: 266 against 291 us a full layer at 256
    # sequences x 2k keys, 526 against 606 at 512 (95% of copy bandwidth against 83-87%).
    wide_waves: float = 12.0
    wide_warps: int = 2
    # An fp8 cache's programs there take 1 warp: at 256 / 512 sequences x 2k keys 215 / 417 us
    # a full layer against 241 / 470 with 2, and 255 / 505 for a bf16 cache (H200, one call,
    # docs/benchmark-log.md); widening to fp16 leaves them issue-bound, at ~60% of copy bandwidth.
    wide_fp8_warps: int = 1


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel (best of a sweep on an H100: docs/benchmark-log.md)."""

    rows: int = 128  # tile rows = BLOCK_T tokens x G_PAD heads
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3  # full layers: long key loops
    sliding_num_stages: int = 2  # sliding layers: ~3 key blocks per tile


DECODE = DecodeConfig()
PREFILL = PrefillConfig()
# Sequences the prefill kernel's tile search reads at a time: one constant, so a batch's number of
# sequences never compiles a variant of its own.
PREFILL_SEQS_A_SCAN = 64


def decode_num_splits(batch: int, num_kv_heads: int, max_keys: int, sm_count: int, cfg: DecodeConfig = DECODE) -> int:
    """Splits per (sequence, KV head): none up to min_chunk keys, else as many as keep the grid
    within `waves` programs a multiprocessor (rounded down: a partial extra wave costs more
    than it hides), each with >= split_keys keys. Small batches are latency-bound: at batch 1
    and 1k keys 16 one-block splits take 5.3 us against 7.7 for 4 of 256 keys (H200,
    docs/benchmark-log.md)."""
    if cfg.num_splits is not None:
        return cfg.num_splits
    if max_keys <= cfg.min_chunk:
        return 1
    programs = batch * num_kv_heads
    wanted = int(cfg.waves * sm_count) // programs
    return max(1, min(wanted, triton.cdiv(max_keys, cfg.split_keys)))


def decode_block_n(batch: int, num_kv_heads: int, splits: int, sm_count: int, cfg: DecodeConfig = DECODE) -> int:
    """Keys per loop step for a grid of batch x num_kv_heads x splits programs (`DecodeConfig`)."""
    if cfg.block_n is not None:
        return cfg.block_n
    programs = batch * num_kv_heads * splits
    return 64 if programs <= cfg.waves * sm_count or programs > cfg.wide_waves * sm_count else 32


def decode_num_warps(
    batch: int, num_kv_heads: int, splits: int, sm_count: int, cfg: DecodeConfig = DECODE, kv_fp8: bool = False
) -> int:
    """Warps a decode program (`DecodeConfig.wide_waves`, `wide_fp8_warps`)."""
    if cfg.num_warps is not None:
        return cfg.num_warps
    if batch * num_kv_heads * splits > cfg.wide_waves * sm_count:
        return cfg.wide_fp8_warps if kv_fp8 else cfg.wide_warps
    return 4


def _check_inputs(q, k_cache, v_cache, sinks) -> tuple[int, int, int, int, int]:
    t, hq, d = q.shape
    _, page_size, hkv, d_cache = k_cache.shape
    if d != d_cache or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if d not in (16, 32, 64, 128) or page_size & (page_size - 1):
        raise ValueError(f"head_dim {d} / page_size {page_size} unsupported (head_dim 16-128, power-of-two pages)")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k_cache/v_cache must share one layout; last dimensions must be contiguous")
    if sinks.numel() != hq:
        raise ValueError(f"sinks has {sinks.numel()} entries for {hq} heads")
    return t, hq, d, page_size, hkv


def paged_sink_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_table: torch.Tensor,
    sinks: torch.Tensor,
    sm_scale: float,
    window: int | None,
    decode_cfg: DecodeConfig = DECODE,
    prefill_cfg: PrefillConfig = PREFILL,
) -> torch.Tensor:
    """Same contract as `sink_attention_reference`: returns [T, Hq, D] in q's dtype.

    Pure decode steps (one token per sequence) take the split-K decode kernel and do no host
    synchronisation (CUDA-graph safe; `meta.context_lens_list` only bounds the work); anything
    else takes the prefill/extend kernel, except that the decode rows ahead of a step's prompts
    (`leading_decode_rows`) take the decode kernel: the prefill kernel gives each a 16-row tile
    of its own and reads its keys in one program, 2.5x the decode kernel's time for 256 rows
    beside a 1,024-token prompt (20b, H200, docs/benchmark-log.md).
    """
    t, hq, d, page_size, hkv = _check_inputs(q, k_cache, v_cache, sinks)
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if is_pure_decode(t, meta):
        _decode(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window, out, decode_cfg)
        return out
    # In one split (what the split rule picks there on gpt-oss), so that a mixed step launches
    # one of the few variants `warm_up_mixed_decode` compiles.
    rows, decode_meta, rest_from, rest_meta = mixed_decode_split(meta)
    if rows:
        _decode(
            q[:rows],
            k_cache,
            v_cache,
            decode_meta,
            block_table[:rows],
            sinks,
            sm_scale,
            window,
            out[:rows],
            dataclasses.replace(decode_cfg, num_splits=1),
        )
        # (A graph's rest starts at 0: its decode rows have no tokens there, and the rows the
        # decode kernel wrote past them, zeros, are the rest's to write. The prefill kernel is an
        # ordinary launch, not a programmatic dependent: it starts once the decode kernel is done.)
        q, block_table, meta = q[rest_from:], block_table[rest_from:], rest_meta
    _prefill(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window, out[rest_from:], prefill_cfg)
    return out


MIXED_DECODE_MIN_ROWS = 64  # fewer decode rows ahead of a prompt stay in the prefill kernel


def mixed_decode_split(
    meta: AttentionMetadata,
) -> tuple[int, AttentionMetadata | None, int, AttentionMetadata]:
    """(rows, their metadata, the first token and sequence of the rest, the rest's metadata)
    where a step's leading decode rows take the decode kernel; (0, None, 0, None) where they
    stay in the prefill kernel. (None there, not `meta`: the split is kept on `meta`, which
    would then hold itself, a cycle only the collector frees.)

    Eagerly the rows are whole groups of 4 (the prefill kernel's sliced context lengths and
    block tables then start 16-byte aligned, as a whole step's do, and need no specialisation of
    their own), from MIXED_DECODE_MIN_ROWS on. A CUDA graph's step (`meta.decode_prefix`) runs
    the decode kernel on its bound of rows, those past the real decode rows attending to
    nothing, and the prefill kernel on the whole step, where the decode rows have no tokens.
    Derived once a step (`meta.derived`): every layer asks, and the slices cost a device
    subtraction."""
    split = meta.derived.get("mixed_decode_split")
    if split is None:
        prefix = meta.decode_prefix
        if prefix is not None and prefix.rows:
            head = AttentionMetadata(
                cu_seqlens_q=prefix.cu_seqlens_q[: prefix.rows + 1],  # unread: one token a row
                context_lens=prefix.context_lens,
                block_tables={kind: table[: prefix.rows] for kind, table in meta.block_tables.items()},
                slot_mapping={},
                positions=meta.positions[: prefix.rows],
                max_q_len=1,
                q_lens=[1] * prefix.rows,
                context_lens_list=meta.context_lens_list[: prefix.rows],
            )
            split = (prefix.rows, head, 0, dataclasses.replace(meta, cu_seqlens_q=prefix.cu_seqlens_q))
        elif (rows := leading_decode_rows(meta) // 4 * 4) >= MIXED_DECODE_MIN_ROWS:
            split = (rows, sequences(meta, 0, rows), rows, sequences(meta, rows, len(meta.q_lens)))
        else:
            split = (0, None, 0, None)
        meta.derived["mixed_decode_split"] = split
    return split


def warm_up_mixed_decode(
    num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, windows, dtype, device, kv_dtype=None
) -> None:
    """Compile the decode kernel's variants that mixed steps launch (their leading decode rows,
    keys already in the cache): one split, each launch shape, each window. No CUDA graph
    capture compiles them (graphs fold RoPE and the cache write in), so without this each would
    compile the first time prompts join a batch of its shape: 30 s of stalls in the first
    serving run on an H200 (docs/benchmark-log.md). The dummies have the engine's dtypes
    (`kv_dtype`: the cache's, None: `dtype`) and a block table 16 pages wide, as
    `step_inputs.table_width` pads a mixed step's, so the specialisations match."""
    rows, pages = 4, 16
    cache = torch.zeros(pages, page_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype, device=device)
    q = torch.zeros(rows, num_q_heads, head_dim, dtype=dtype, device=device)
    sinks = torch.zeros(num_q_heads, dtype=torch.float32, device=device)
    table = torch.arange(rows * pages, dtype=torch.int32, device=device).view(rows, pages) % pages
    meta = AttentionMetadata(
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device),
        context_lens=torch.full((rows,), page_size, dtype=torch.int32, device=device),
        block_tables={},
        slot_mapping={},
        positions=torch.zeros(rows, dtype=torch.int64, device=device),
        max_q_len=1,
        q_lens=[1] * rows,
        context_lens_list=[page_size] * rows,
    )
    wide_warps = DECODE.wide_fp8_warps if cache.dtype == FP8_KV_DTYPE else DECODE.wide_warps
    for window in windows:
        for block_n, warps in ((32, 4), (64, 4), (64, wide_warps)):  # what decode_block_n, decode_num_warps pick
            cfg = dataclasses.replace(DECODE, num_splits=1, block_n=block_n, num_warps=warps)
            _decode(q, cache, cache, meta, table, sinks, 1.0, window, torch.empty_like(q), cfg)


def sequences(meta: AttentionMetadata, start: int, stop: int) -> AttentionMetadata:
    """Sequences start..stop-1 of a step as a step of their own (views; one subtraction on the
    device when start > 0, for the query offsets)."""
    t0, t1 = sum(meta.q_lens[:start]), sum(meta.q_lens[:stop])
    cu = meta.cu_seqlens_q[start : stop + 1]
    return AttentionMetadata(
        cu_seqlens_q=cu - t0 if t0 else cu,
        context_lens=meta.context_lens[start:stop],
        block_tables={kind: table[start:stop] for kind, table in meta.block_tables.items()},
        slot_mapping={kind: slots[t0:t1] for kind, slots in meta.slot_mapping.items()},
        positions=meta.positions[t0:t1],
        max_q_len=max(meta.q_lens[start:stop]),
        q_lens=meta.q_lens[start:stop],
        context_lens_list=meta.context_lens_list[start:stop],
    )


def is_pure_decode(num_tokens: int, meta: AttentionMetadata) -> bool:
    """One new token per sequence: the step the decode kernel serves."""
    return meta.max_q_len == 1 and num_tokens == len(meta.q_lens)


def decode_attention_with_new_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    sinks: torch.Tensor,
    sm_scale: float,
    window: int | None,
    decode_cfg: DecodeConfig = DECODE,
) -> torch.Tensor:
    """`rope_and_write_kv` then `paged_sink_attention` for a pure decode step, in one launch
    (plus the split combine): q [B, Hq, D] and k, v [B, Hkv, D] as projected (not rotated, not
    yet in the cache), positions from `meta.positions`. Returns [B, Hq, D] in q's dtype and
    leaves rotated k and v at `slot_mapping`'s slots, as the two separate calls would."""
    t, hq, d, page_size, hkv = _check_inputs(q, k_cache, v_cache, sinks)
    if not is_pure_decode(t, meta):
        raise ValueError("decode_attention_with_new_kv takes pure decode steps (one new token per sequence)")
    if k.shape != (t, hkv, d) or v.shape != (t, hkv, d) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k and v must be [{t}, {hkv}, {d}] with a contiguous last dimension")
    if cos_sin.shape[-1] != d or cos_sin.stride(-1) != 1:
        raise ValueError(f"cos_sin must be [positions, {d}] with a contiguous last dimension")
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        _decode(
            q,
            k_cache,
            v_cache,
            meta,
            block_table,
            sinks,
            sm_scale,
            window,
            out,
            decode_cfg,
            new_kv=(k, v, cos_sin, slot_mapping),
        )
    return out


def _decode(
    q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window, out, cfg: DecodeConfig, new_kv=None
) -> None:
    batch, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    max_keys = max(meta.context_lens_list)
    if window is not None:
        max_keys = min(max_keys, window)
    sm_count = multiprocessors(q.device)
    splits = decode_num_splits(batch, hkv, max_keys, sm_count, cfg)
    block_n = decode_block_n(batch, hkv, splits, sm_count, cfg)
    num_warps = decode_num_warps(batch, hkv, splits, sm_count, cfg, k_cache.dtype == FP8_KV_DTYPE)
    split = splits > 1
    if split:
        part_acc = torch.empty((batch, hq, splits, d), dtype=torch.float32, device=q.device)
        part_max = torch.empty((batch, hq, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    k_new, v_new, cos_sin, slots = new_kv or (q, q, q, q)  # unused without new_kv
    _decode_kernel[(batch, hkv, splits)](
        q,
        k_cache,
        v_cache,
        sinks,
        block_table,
        meta.context_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        k_new,
        v_new,
        meta.positions,
        cos_sin,
        slots,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos_sin.stride(0),
        sm_scale * LOG2E,
        window or 0,
        splits,
        NUM_Q_HEADS=hq,
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        SLIDING=window is not None,
        SPLIT=split,
        NEW_KV=new_kv is not None,
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        num_warps=num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(q.device, dependent=False),
    )
    if split:
        # A dependent: placed while the splits run, it waits for their partials first thing
        # (batch 1: 663-665 against 660-663 tok/s, H200, docs/benchmark-log.md).
        _combine_kernel[(batch, hq)](
            part_acc,
            part_max,
            part_sum,
            sinks,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            NUM_Q_HEADS=hq,
            HEAD_DIM=d,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=1,
            **pdl_options(q.device, dependent=True),
        )


def _prefill(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window, out, cfg: PrefillConfig) -> None:
    """The grid comes from meta.q_lens. A CUDA graph's metadata holds bounds there (its
    sequences' new tokens come from cu_seqlens_q on the device): with q_lens = [Q] + [1] * (S - 1)
    the grid covers any S sequences of Q tokens in all (ceil(a) + ceil(b) <= ceil(a + b) + 1), and
    the programs past the step's tiles return at once."""
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    block_t = max(1, cfg.rows // g_pad)
    while block_t * g_pad < 16:  # tl.dot needs at least 16 rows
        block_t *= 2
    num_seqs = len(meta.q_lens)
    num_tiles = sum(-(-n // block_t) for n in meta.q_lens)
    if num_tiles == 0:
        return
    _prefill_kernel[(num_tiles, hkv)](
        q,
        k_cache,
        v_cache,
        sinks,
        block_table,
        meta.context_lens,
        meta.cu_seqlens_q,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        sm_scale * LOG2E,
        window or 0,
        num_seqs,
        G=group,
        G_PAD=g_pad,
        BLOCK_T=block_t,
        HEAD_DIM=d,
        PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n,
        SLIDING=window is not None,
        BLOCK_B=PREFILL_SEQS_A_SCAN,
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        num_warps=cfg.num_warps,
        num_stages=cfg.sliding_num_stages if window is not None else cfg.num_stages,
    )
