"""Sink attention over a paged KV cache: the step metadata, the reference math, backend choice.

KV cache layout (one pair of tensors per layer):
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim], in the model's dtype or
    float8 e4m3 (`cache_values`); attention computes in the queries' dtype either way
A sequence's logical page i (token positions i*page_size .. (i+1)*page_size-1) lives in physical
page `block_table[seq, i]`. Sliding-window layers use their own block table, in which pages that
fell out of the window may have been freed (entry -1); attention on those layers never reads them.

A step processes a ragged batch: sequence b contributes `q_len[b]` new tokens (1 for decode,
more for prefill/extend) whose K/V were already written to the cache; it has `context_len[b]`
tokens in total (cached + new). New token i of sequence b sits at absolute position
`context_len[b] - q_len[b] + i` and attends to keys at positions j with j <= pos and, on sliding
layers, j > pos - window.

Per head h the softmax has one extra logit, the learned sink:
    p_j = exp(s_j - m) / (exp(sink_h - m) + sum_k exp(s_k - m)),  s_j = q . k_j * sm_scale
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers.

    Shapes (B sequences, T new tokens in total, P max pages per sequence):
        cu_seqlens_q:   [B+1] int32, offsets of each sequence's new tokens in the flat batch
        context_lens:   [B] int32, total tokens per sequence including the new ones
        block_tables:   {"full": [B, P] int32, "sliding": [B, P] int32}; -1 = no page
        slot_mapping:   {"full": [T] int64, "sliding": [T] int64}, physical slot
                        (page * page_size + offset) where each new token's K/V go
        positions:      [T] int64 absolute positions of the new tokens
        max_q_len:      python int, max new tokens of any sequence (1 means pure decode)
        q_lens / context_lens_list: the same numbers as python lists (no device sync needed)
    """

    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    positions: torch.Tensor
    max_q_len: int
    q_lens: list[int]
    context_lens_list: list[int]
    # A CUDA graph's step, whose lists hold bounds, marks its leading decode rows this way (the
    # backends free to ignore it: the fields above describe the whole step).
    decode_prefix: DecodePrefix | None = None
    # What a backend derives from this step once and every layer reuses (a step's own: a new
    # step's metadata, or one made by dataclasses.replace, starts without it).
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1


@dataclass
class DecodePrefix:
    """The leading decode rows of a step whose count only the device knows (a CUDA graph's step:
    one graph serves every mix of decode rows and prompts of its token bucket), so that a kernel
    made for decode can take them at a fixed size.

        rows:          python int, a bound: the first `rows` tokens (and sequences) include the
                       step's d decode rows, each one token of its own sequence
        context_lens:  [rows] int32, the context lengths of the d decode rows, then 0: a row
                       past them attends to nothing
        cu_seqlens_q:  [B+1] int32, the step's offsets with the decode rows' tokens taken out
                       (max(cu_seqlens_q, d)): its first d sequences have no new tokens
    """

    rows: int
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor


def leading_decode_rows(meta: AttentionMetadata) -> int:
    """How many sequences at the front of a step have one new token each. The scheduler puts
    running sequences first, so where prompts join a batch these are its decode rows. 0 for a
    CUDA graph's step metadata, whose lists hold bounds that start with the step's tokens."""
    for i, n in enumerate(meta.q_lens):
        if n != 1:
            return i
    return len(meta.q_lens)


# An fp8 cache (`EngineConfig.kv_cache_dtype` "fp8") holds float8 e4m3 with no scale: 3 mantissa
# bits (4 significant), normal from 2^-6, largest finite value 448 (`torch.finfo(torch.float8_e4m3fn).max`).
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0


def cache_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values (already rounded to the model's dtype) as a cache of `dtype` stores them.
    An fp8 cache saturates at +-FP8_KV_MAX: an out-of-range key is clipped, never inf or NaN."""
    if dtype == FP8_KV_DTYPE:
        x = x.clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return x.to(dtype)


def store_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [num_pages, page_size, Hkv, D]; rows [N, Hkv, D] go to flat slots [N] (all >= 0)."""
    num_pages, page_size, hkv, d = cache.shape
    flat = cache.view(num_pages * page_size, hkv, d)
    rows = cache_values(rows, cache.dtype)
    if cache.dtype == FP8_KV_DTYPE:  # index_copy_ has no float8 kernel on CPU; the bytes are the same
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new keys/values. k, v: [T, Hkv, D]; slots: [T] int64 flat slot ids (-1: skip)."""
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    store_slots(k_cache, slots, k)
    store_slots(v_cache, slots, v)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Keys (or values) of positions [start, end) of one sequence: [end-start, Hkv, D]."""
    page_size = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    pages = block_table_row[pos // page_size].long()
    if bool((pages < 0).any()):
        raise RuntimeError("attention would read a freed page")
    return cache[pages, pos % page_size]


def sink_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_table: torch.Tensor,
    sinks: torch.Tensor,
    sm_scale: float,
    window: int | None,
) -> torch.Tensor:
    """Reference paged sink attention in float32.

    q: [T, Hq, D] new queries; sinks: [Hq]; window: None for full attention.
    Returns [T, Hq, D] in q's dtype.
    """
    t_total, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    offset = 0
    for b, (q_len, ctx) in enumerate(zip(meta.q_lens, meta.context_lens_list)):
        if q_len == 0:
            continue
        first_pos = ctx - q_len
        # Oldest key any of these queries may see.
        lo = 0 if window is None else max(0, first_pos - window + 1)
        k = gather_kv(k_cache, block_table[b], lo, ctx).float()  # [L, Hkv, D]
        v = gather_kv(v_cache, block_table[b], lo, ctx).float()
        qb = q[offset : offset + q_len].float()  # [q_len, Hq, D]
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale  # [Hq, q_len, L]
        q_pos = torch.arange(first_pos, ctx, device=q.device)[:, None]
        k_pos = torch.arange(lo, ctx, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        sink = sinks.float().view(hq, 1, 1).expand(hq, q_len, 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[offset : offset + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        offset += q_len
    return out
