"""RoPE on q and k, and the K/V cache write, fused into one pass over the new tokens.

Rotation is gpt-oss's "rotate half": for a head vector x = [x1 | x2] (halves of D/2),
    out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin
with cos/sin read from one row per token of a precomputed table `cos_sin [max_pos, D]` float32
(cos in the first half, sin in the second; YaRN's attention factor already folded in).

`rope_and_write_kv_reference` is the pure-torch definition; `rope_and_write_kv_triton` computes
the same thing in one launch (one program per token: rotate every q and k head, store q, and
store rotated k plus v at the token's cache slot unless the slot is -1). An fp8 cache gets
keys and values rounded to the model's dtype, then saturated and rounded to fp8 (`cache_values`).
"""

from __future__ import annotations

import torch

from inference.ops.attention.reference import FP8_KV_DTYPE, FP8_KV_MAX, store_slots

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference below needs no Triton
    triton = None


def rotate_half(x: torch.Tensor, cos_sin_rows: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos_sin_rows: [T, D] float32. Math in float32, result in x's dtype."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin_rows[:, None, :half], cos_sin_rows[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_and_write_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], positions [T] int64, slot_mapping [T] int64 (-1: skip).

    Writes rotated k and v into the caches [num_pages, page_size, Hkv, D]; returns rotated q.
    """
    rows = cos_sin[positions].float()
    q_rot = rotate_half(q, rows)
    k_rot = rotate_half(k, rows)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    store_slots(k_cache, slots, k_rot[keep])
    store_slots(v_cache, slots, v[keep])
    return q_rot


if triton is not None:
    _FP8_KV_MAX = tl.constexpr(FP8_KV_MAX)

    @triton.jit
    def to_cache_dtype(x, Cache, FP8: tl.constexpr):
        """Keys or values, already rounded to the model's dtype, as the cache at pointer `Cache`
        stores them (`cache_values`): an fp8 cache (FP8) saturates at +-448."""
        if FP8:
            x = tl.clamp(x.to(tl.float32), -_FP8_KV_MAX, _FP8_KV_MAX)
        return x.to(Cache.dtype.element_ty)

    @triton.jit
    def as_cached(x, Cache, FP8: tl.constexpr):
        """x (the model's dtype) as float32 holding what the cache at pointer `Cache` stores: for an
        fp8 cache (FP8) e4m3 rounded to nearest even, saturated at +-448, computed in float32.
        (Not an fp8 round trip in registers: on an H200 under triton 3.6, widening a [16, 64] fp8
        tensor that the program had just narrowed gave wrong values, docs/benchmark-log.md.)"""
        if FP8:
            f = tl.clamp(x.to(tl.float32), -_FP8_KV_MAX, _FP8_KV_MAX)
            # Normal e4m3 (from 2^-6) keeps 3 of float32's 23 mantissa bits: round the other 20 off
            # to nearest even on the bits. Below 2^-6 e4m3 is subnormal, spaced 2^-9: round
            # f * 2^9 to an integer by adding and subtracting 1.5 * 2^23.
            bits = f.to(tl.int32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
            subnormal = ((f * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
            value = tl.where(tl.abs(f) < 0.015625, subnormal, normal)
        else:
            value = x.to(Cache.dtype.element_ty).to(tl.float32)
        return value

    @triton.jit
    def _rotate_store(
        src, dst, rows, row_mask, stride_src_h, stride_dst_h, cos, sin, HALF: tl.constexpr, FP8: tl.constexpr
    ):
        """Rotate heads `rows` of one token at `src` and store them at `dst` (both head-major),
        rounded to src's dtype first (then to an fp8 cache's, with FP8), as the reference does."""
        cols = tl.arange(0, HALF)
        src_ptr = src + rows[:, None] * stride_src_h + cols[None, :]
        x1 = tl.load(src_ptr, mask=row_mask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + HALF, mask=row_mask[:, None], other=0.0).to(tl.float32)
        dst_ptr = dst + rows[:, None] * stride_dst_h + cols[None, :]
        out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(src.dtype.element_ty)
        out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(src.dtype.element_ty)
        tl.store(dst_ptr, to_cache_dtype(out1, dst, FP8), mask=row_mask[:, None])
        tl.store(dst_ptr + HALF, to_cache_dtype(out2, dst, FP8), mask=row_mask[:, None])

    @triton.jit
    def _rope_write_kv_kernel(
        Q,
        K,
        V,
        Positions,
        CosSin,
        KCache,
        VCache,
        Slots,
        QOut,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cos,
        stride_cache_page,
        stride_cache_slot,
        stride_cache_h,
        stride_qout_t,
        stride_qout_h,
        page_size,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HKV: tl.constexpr,
        HALF: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(Positions + t).to(tl.int64)
        cols = tl.arange(0, HALF)
        cos = tl.load(CosSin + pos * stride_cos + cols).to(tl.float32)
        sin = tl.load(CosSin + pos * stride_cos + HALF + cols).to(tl.float32)

        q_heads = tl.arange(0, BLOCK_HQ)
        _rotate_store(
            Q + t * stride_qt,
            QOut + t * stride_qout_t,
            q_heads,
            q_heads < HQ,
            stride_qh,
            stride_qout_h,
            cos,
            sin,
            HALF,
            False,
        )

        slot = tl.load(Slots + t)
        if slot >= 0:
            dst = (slot // page_size) * stride_cache_page + (slot % page_size) * stride_cache_slot
            kv_heads = tl.arange(0, BLOCK_HKV)
            kv_mask = kv_heads < HKV
            _rotate_store(
                K + t * stride_kt, KCache + dst, kv_heads, kv_mask, stride_kh, stride_cache_h, cos, sin, HALF, KV_FP8
            )
            d = tl.arange(0, 2 * HALF)
            v = tl.load(V + t * stride_vt + kv_heads[:, None] * stride_vh + d[None, :], mask=kv_mask[:, None])
            tl.store(
                VCache + dst + kv_heads[:, None] * stride_cache_h + d[None, :],
                to_cache_dtype(v, VCache, KV_FP8),
                mask=kv_mask[:, None],
            )


def rope_and_write_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `rope_and_write_kv_reference`, one Triton launch."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous last dimension")
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("q, k, v and cos_sin need a contiguous last dimension")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    _rope_write_kv_kernel[(t,)](
        q,
        k,
        v,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        slot_mapping,
        q_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.shape[1],
        HQ=hq,
        HKV=hkv,
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HKV=triton.next_power_of_2(hkv),
        HALF=d // 2,
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        num_warps=4,
    )
    return q_out
