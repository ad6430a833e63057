"""GPU attention path: Triton paged sink attention and fused RoPE + cache write vs pure torch.

On a CUDA machine the kernels run for real (bf16, relative error < 1e-2). Without CUDA they run
under Triton's interpreter (TRITON_INTERPRET=1, float32, tiny shapes); without Triton those tests
skip and only the reference-path tests run.

Every case poisons what attention must not read: the cache starts as NaN and only the positions
a sequence's queries may see get real values; on sliding layers the pages below the window are
freed (-1 in the block table) and physical page -1 (a guard page just before the cache view) is
NaN too. Reading anything outside the window therefore turns the output into NaN.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from inference.ops.attention.backend import ReferenceAttentionBackend, select_attention_backend  # noqa: E402
from inference.ops.attention.reference import (  # noqa: E402
    FP8_KV_DTYPE,
    AttentionMetadata,
    cache_values,
    sink_attention_reference,
    write_kv,
)
from inference.ops.attention.rope_cache import rope_and_write_kv_reference, rotate_half  # noqa: E402
from tests.triton_interpreter import (  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)
    CUDA,
    DEVICE,
    DTYPE,
    fresh_process_only,
    gpu_only,
    kernel_module,
    needs_triton,
    run_in_fresh_interpreter,
)

TOL = 1e-2 if CUDA else 1e-4
_AS_CACHED = None  # set by test_triton_fp8_rounding_in_float32_matches_torch


def _kernel_modules():
    """The Triton modules, interpreted on CPU."""
    return (
        kernel_module("inference.ops.attention.triton", "_decode_kernel"),
        kernel_module("inference.ops.attention.rope_cache", "_rope_write_kv_kernel"),
    )


@fresh_process_only
def test_triton_in_fresh_interpreter():
    """Run this file's Triton tests in a new interpreter-mode process."""
    run_in_fresh_interpreter(__file__)


# ----------------------------------------------------------------------------- test batches


def make_batch(
    seed: int,
    q_lens: list[int],
    context_lens: list[int],
    heads: tuple[int, int, int],
    page_size: int,
    window: int | None,
    dtype=DTYPE,
    device=DEVICE,
    whole_pages: bool = False,
    kv_dtype=None,
):
    """A random paged step. Returns (q, k_cache, v_cache, meta, block_table, sinks, sm_scale).
    `kv_dtype`: the caches' dtype (default: dtype), e.g. fp8; NaN stays NaN in it.

    Pages are scattered over a shuffled pool; every cache entry a query may not see is NaN.
    `whole_pages`: the slots below the window in a sequence's oldest kept page hold values too
    (as in a real cache, where the sequence wrote them): for kernels that load whole pages and
    mask scores, which multiplies a NaN value by a zero weight.
    """
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-c // page_size) for c in context_lens]
    max_pages = max(pages)
    pool = sum(pages) + 3  # a few spare pages nobody owns
    # Storage page 0 is a NaN guard: the caches handed to attention start at page 1, so a
    # block-table entry of -1 addresses the guard.
    k_store = torch.full((pool + 1, page_size, hkv, d), float("nan"), dtype=dtype)
    v_store = torch.full_like(k_store, float("nan"))
    k_cache, v_cache = k_store[1:], v_store[1:]
    order = torch.randperm(pool, generator=gen).tolist()
    block_table = torch.full((len(q_lens), max_pages + 2), -1, dtype=torch.int32)
    for b, (q_len, ctx) in enumerate(zip(q_lens, context_lens)):
        owned = [order.pop() for _ in range(pages[b])]
        lo = 0 if window is None else max(0, ctx - q_len - window + 1)
        for i, page in enumerate(owned):
            if (i + 1) * page_size <= lo:
                continue  # freed: wholly below every query's window
            block_table[b, i] = page
        pos = torch.arange(lo - lo % page_size if whole_pages else lo, ctx)
        page, off = torch.tensor(owned, dtype=torch.long)[pos // page_size], pos % page_size
        k_cache[page, off] = torch.randn(len(pos), hkv, d, generator=gen).to(dtype)
        v_cache[page, off] = torch.randn(len(pos), hkv, d, generator=gen).to(dtype)
    total = sum(q_lens)
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    sinks = torch.randn(hq, generator=gen) * 2
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, context_lens)]).long()
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables={"full": block_table, "sliding": block_table},
        slot_mapping={"full": torch.full((total,), -1), "sliding": torch.full((total,), -1)},
        positions=positions,
        max_q_len=max(q_lens),
        q_lens=list(q_lens),
        context_lens_list=list(context_lens),
    )
    to = lambda t: t.to(device)  # noqa: E731
    meta = AttentionMetadata(
        cu_seqlens_q=to(meta.cu_seqlens_q),
        context_lens=to(meta.context_lens),
        block_tables={k: to(v) for k, v in meta.block_tables.items()},
        slot_mapping={k: to(v) for k, v in meta.slot_mapping.items()},
        positions=to(meta.positions),
        max_q_len=meta.max_q_len,
        q_lens=meta.q_lens,
        context_lens_list=meta.context_lens_list,
    )
    if kv_dtype is not None:
        k_store, v_store = k_store.to(kv_dtype), v_store.to(kv_dtype)
    k_cache, v_cache = to(k_store)[1:], to(v_store)[1:]  # slice after the move: keep the guard page
    return to(q), k_cache, v_cache, meta, to(block_table), to(sinks), 1 / math.sqrt(d)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(ref).all(), "the reference itself read poisoned entries"
    assert torch.isfinite(out).all(), "kernel output has NaN/inf (read outside the window or unwritten)"
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check_attention(kernel, seed, q_lens, context_lens, heads, page_size, window, kv_dtype=None, **kw):
    q, k_cache, v_cache, meta, table, sinks, scale = make_batch(
        seed, q_lens, context_lens, heads, page_size, window, kv_dtype=kv_dtype
    )
    ref = sink_attention_reference(q, k_cache, v_cache, meta, table, sinks, scale, window)
    out = kernel(q, k_cache, v_cache, meta, table, sinks, scale, window, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    err = relative_error(out, ref)
    tol = TOL if kv_dtype is None else max(TOL, 1e-3)  # an fp8 cache's MMAs take fp16
    assert err < tol, f"relative error {err:.2e}"


# ----------------------------------------------------------------------------- reference path


def naive_sink_attention(q, keys, values, sinks, scale, positions, window):
    """One query at a time over a sequence's dense keys [L, Hkv, D] (independent of the paging)."""
    hq, hkv = q.shape[1], keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(positions):
        for h in range(hq):
            kv = h // (hq // hkv)
            first = 0 if window is None else max(0, pos - window + 1)
            s = keys[first : pos + 1, kv].double() @ q[i, h].double() * scale
            logits = torch.cat([s, sinks[h : h + 1].double()])
            p = torch.softmax(logits, 0)[:-1]
            out[i, h] = p @ values[first : pos + 1, kv].double()
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_reference_backend_matches_naive_attention(window):
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, page_size, ctx, new = 4, 2, 8, 4, 13, 6
    keys, values = torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen)
    q, sinks = torch.randn(new, hq, d, generator=gen), torch.randn(hq, generator=gen)
    pages = torch.tensor([3, 0, 2, 1], dtype=torch.int32)  # logical page i -> physical pages[i]
    k_cache = torch.zeros(4, page_size, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    for pos in range(ctx):
        k_cache[pages[pos // page_size], pos % page_size] = keys[pos]
        v_cache[pages[pos // page_size], pos % page_size] = values[pos]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, new], dtype=torch.int32),
        context_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables={},
        slot_mapping={},
        positions=torch.arange(ctx - new, ctx),
        max_q_len=new,
        q_lens=[new],
        context_lens_list=[ctx],
    )
    out = ReferenceAttentionBackend.attention(q, k_cache, v_cache, meta, pages[None], sinks, 0.3, window)
    expected = naive_sink_attention(q, keys, values, sinks, 0.3, range(ctx - new, ctx), window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # The sink matters: dropping it changes the answer.
    no_sink = naive_sink_attention(q, keys, values, sinks - 1e4, 0.3, range(ctx - new, ctx), window)
    assert (out.double() - no_sink).abs().max() > 1e-3


def complex_rope(x: torch.Tensor, cos_sin_rows: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE written as complex multiplication (x1 + i x2) * (cos + i sin)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    w = torch.complex(cos_sin_rows[:, None, :half].double(), cos_sin_rows[:, None, half:].double())
    r = z * w
    return torch.cat([r.real, r.imag], dim=-1)


def rope_inputs(seed, t=7, hq=6, hkv=2, d=16, page_size=4, num_pages=5, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype)  # views into one qkv tensor, like the model
    q, k, v = q[:, :hq], q[:, hq : hq + hkv], q[:, hq + hkv :]
    positions = torch.randint(0, 50, (t,), generator=gen)
    angles = torch.rand(50, d // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1) * 1.3  # scaled like YaRN's attention factor
    slots = torch.randperm(num_pages * page_size, generator=gen)[:t]
    slots[2] = -1
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    to = lambda x: x.to(device)  # noqa: E731
    return tuple(map(to, (q, k, v, positions, cos_sin, k_cache, v_cache, slots)))


def test_rope_and_write_kv_reference():
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = rope_inputs(0)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_rot = rope_and_write_kv_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    rows = cos_sin[positions]
    torch.testing.assert_close(q_rot.double(), complex_rope(q, rows), atol=1e-5, rtol=1e-5)
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    k_rot = complex_rope(k, rows)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot].double(), k_rot[i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(flat_v[slot], v[i])
    # Only the written slots changed (slot -1 was skipped).
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(flat_k[~written], k_before.view_as(flat_k)[~written])
    assert torch.equal(flat_v[~written], v_before.view_as(flat_v)[~written])


def test_rope_reference_is_the_models_rope():
    """Same numbers as inference/model/rope.py on a real YaRN table (the model's own path)."""
    from inference.config import RopeConfig
    from inference.model.rope import apply_rope, cos_sin_table

    table = cos_sin_table(RopeConfig(), 64, 5000)
    q, k, v, _, _, k_cache, v_cache, slots = rope_inputs(4, d=64, num_pages=4)
    positions = torch.tensor([0, 1, 7, 100, 4095, 4096, 4999])
    q_rot = rope_and_write_kv_reference(q, k, v, positions, table, k_cache, v_cache, slots)
    assert torch.equal(q_rot, apply_rope(q, table[positions]))


def test_fp8_cache_values_round_to_nearest_even_and_saturate():
    """What an fp8 cache stores: e4m3 rounded to nearest (ties to even), clipped at +-448, never
    inf or NaN; a cache in the model's dtype takes values as they are."""
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, -3.3, 447.9, 500.0, -1e6, 2.0**-9, 2.0**-12])
    out = cache_values(x, FP8_KV_DTYPE)
    assert out.dtype == FP8_KV_DTYPE
    assert out.float().tolist() == [0.0, 1.0, 1.0, 1.25, -3.25, 448.0, 448.0, -448.0, 2.0**-9, 0.0]
    assert torch.equal(cache_values(x, torch.float32), x)


def test_reference_writes_into_fp8_caches():
    """`rope_and_write_kv_reference` and `write_kv` into fp8 caches (CPU has no float8 index_copy_):
    rotated keys rounded to k's dtype, then saturated to fp8; values the same; skipped slots and
    every other slot unchanged."""
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = rope_inputs(3)
    k = k * 400  # some rotated keys past 448
    k_cache, v_cache = k_cache.to(FP8_KV_DTYPE), v_cache.to(FP8_KV_DTYPE)
    k_before, v_before = k_cache.float(), v_cache.float()
    rope_and_write_kv_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    keep = slots >= 0
    k_rot = rotate_half(k, cos_sin[positions])
    flat_k, flat_v = k_cache.float().view(-1, *k_cache.shape[2:]), v_cache.float().view(-1, *v_cache.shape[2:])
    assert torch.equal(flat_k[slots[keep]], cache_values(k_rot[keep], FP8_KV_DTYPE).float())
    assert torch.equal(flat_v[slots[keep]], cache_values(v[keep], FP8_KV_DTYPE).float())
    assert flat_k.abs().max() == 448.0 and torch.isfinite(flat_k).all()
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots[keep]] = True
    assert torch.equal(flat_k[~written], k_before.view_as(flat_k)[~written])
    assert torch.equal(flat_v[~written], v_before.view_as(flat_v)[~written])

    k_cache.zero_(), v_cache.zero_()
    write_kv(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.float().view(-1, *k_cache.shape[2:])
    assert torch.equal(flat_k[slots[keep]], cache_values(k[keep], FP8_KV_DTYPE).float())
    assert flat_k[~written].abs().max() == 0


def test_backend_selection():
    assert select_attention_backend("cpu").name == "reference"
    assert select_attention_backend("cpu", "reference").name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("cpu", "fastest")
    if not CUDA:
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            select_attention_backend("cpu", "triton")
    else:
        from inference.ops.attention.backend import flashinfer_usable

        assert select_attention_backend("cuda").name == ("flashinfer" if flashinfer_usable(DEVICE) else "triton")
        assert select_attention_backend("cuda", "triton").name == "triton"


# ----------------------------------------------------------------------------- Triton kernels
# Tiny shapes (interpreter) on CPU; the GPU adds the real gpt-oss shapes below.


def small_cfgs(attention_triton):
    return dict(
        decode_cfg=attention_triton.DecodeConfig(block_n=16, min_chunk=16, split_keys=16),
        prefill_cfg=attention_triton.PrefillConfig(rows=16, block_n=16),
    )


HEADS = [(4, 2, 16), (6, 2, 32), (8, 1, 16)]  # GQA 2, 3 (not a power of two), 8


@needs_triton
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("page_size", [4, 16])
def test_triton_decode(heads, window, page_size):
    attention_triton, _ = _kernel_modules()
    lens = [1, 9, 23, 40]  # inside and across the window, not multiples of the page size
    check_attention(
        attention_triton.paged_sink_attention,
        11,
        [1] * len(lens),
        lens,
        heads,
        page_size,
        window,
        **small_cfgs(attention_triton),
    )


@needs_triton
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_triton_decode_splits(splits):
    attention_triton, _ = _kernel_modules()
    cfgs = small_cfgs(attention_triton)
    cfgs["decode_cfg"] = attention_triton.DecodeConfig(block_n=16, num_splits=splits)
    for window in (None, 8):
        check_attention(
            attention_triton.paged_sink_attention, 5 + splits, [1, 1, 1], [3, 70, 33], (4, 2, 16), 8, window, **cfgs
        )


@needs_triton
def test_triton_decode_split_count():
    """No split up to min_chunk keys (a sliding layer's window); past it, as many splits as fit
    in 4 programs a multiprocessor (rounded down), none under split_keys keys; 64-key steps
    while the grid stays within those programs, 32-key steps past them, and 64-key steps in
    2-warp programs past 12 a multiprocessor (serving batches)."""
    attention_triton, _ = _kernel_modules()
    splits = attention_triton.decode_num_splits
    block_n = attention_triton.decode_block_n
    warps = attention_triton.decode_num_warps
    assert splits(1, 8, 128, 132) == 1  # batch 1, sliding layer
    assert splits(1, 8, 1024, 132) == 16  # batch 1, 1k keys: one 64-key block a split
    assert splits(1, 8, 32768, 132) == 66  # 4 programs a multiprocessor
    assert splits(8, 8, 4096, 132) == 8 and splits(32, 8, 1024, 132) == 2
    assert splits(64, 8, 8192, 132) == 1 and splits(128, 8, 1024, 132) == 1  # 512 programs already
    assert splits(1, 8, 1024, 132, attention_triton.DecodeConfig(num_splits=3)) == 3
    assert block_n(1, 8, 66, 132) == 64 and block_n(64, 8, 1, 132) == 64 and block_n(32, 8, 2, 132) == 64
    assert block_n(128, 8, 1, 132) == 32 and block_n(64, 8, 2, 132) == 32
    assert block_n(128, 8, 1, 132, attention_triton.DecodeConfig(block_n=64)) == 64
    assert warps(128, 8, 1, 132) == 4 and warps(64, 8, 1, 132) == 4 and warps(1, 8, 66, 132) == 4
    assert block_n(256, 8, 1, 132) == 64 and warps(256, 8, 1, 132) == 2  # 2,048 programs
    assert block_n(198, 8, 1, 132) == 32 and warps(198, 8, 1, 132) == 4  # 1,584: 12 a multiprocessor
    assert block_n(512, 8, 1, 132) == 64 and warps(512, 8, 1, 132) == 2
    assert warps(256, 8, 1, 132, attention_triton.DecodeConfig(num_warps=4)) == 4
    assert warps(256, 8, 1, 132, kv_fp8=True) == 1 and warps(128, 8, 1, 132, kv_fp8=True) == 4  # fp8 cache


@needs_triton
def test_triton_mixed_decode_warm_up_covers_every_launch_shape(monkeypatch):
    """`warm_up_mixed_decode` compiles each (keys a step, warps) that the decode rules pick for a
    mixed step's decode rows (one split), whatever their count, so none compiles while serving."""
    attention_triton, _ = _kernel_modules()
    warmed = set()
    monkeypatch.setattr(attention_triton, "_decode", lambda *args: warmed.add((args[-1].block_n, args[-1].num_warps)))
    attention_triton.warm_up_mixed_decode(64, 8, 64, 16, [None, 128], torch.float32, "cpu")
    pick = attention_triton.decode_block_n, attention_triton.decode_num_warps
    shapes = {tuple(f(rows, 8, 1, sm) for f in pick) for rows in range(1, 1025) for sm in (78, 114, 132)}
    assert shapes == warmed == {(32, 4), (64, 4), (64, 2)}
    warmed.clear()  # an fp8 cache's
    attention_triton.warm_up_mixed_decode(64, 8, 64, 16, [None], torch.float32, "cpu", FP8_KV_DTYPE)
    block_n, warps = pick
    shapes = {
        (block_n(rows, 8, 1, sm), warps(rows, 8, 1, sm, kv_fp8=True)) for rows in range(1, 1025) for sm in (78, 132)
    }
    assert shapes == warmed == {(32, 4), (64, 4), (64, 1)}


def newest_slots(meta, table, page_size):
    """The physical slot of each sequence's newest position (where its new K/V belong)."""
    slots = []
    for b, ctx in enumerate(meta.context_lens_list):
        pos = ctx - 1
        slots.append(int(table[b, pos // page_size]) * page_size + pos % page_size)
    return torch.tensor(slots, dtype=torch.long, device=DEVICE)


def check_decode_with_new_kv(decode_with_new_kv, seed, lens, heads, page_size, window, skip=(), kv_dtype=None, **kw):
    """The fused kernel against `rope_and_write_kv_reference` then `sink_attention_reference`:
    outputs and both whole caches. The newest position starts as NaN in the cache (the step's K/V
    are not there yet), so a kernel that read it instead of the projected k and v fails. Sequences
    in `skip` get slot -1 (nothing written; their outputs are not compared)."""
    hq, hkv, d = heads
    q, k_cache, v_cache, meta, table, sinks, scale = make_batch(
        seed, [1] * len(lens), lens, heads, page_size, window, kv_dtype=kv_dtype
    )
    gen = torch.Generator().manual_seed(seed + 1)
    k_new = torch.randn(len(lens), hkv, d, generator=gen).to(DTYPE).to(DEVICE)
    v_new = torch.randn(len(lens), hkv, d, generator=gen).to(DTYPE).to(DEVICE)
    angles = torch.rand(max(lens), d // 2, generator=gen) * 6.3
    cos_sin = (torch.cat([angles.cos(), angles.sin()], -1) * 1.3).to(DEVICE)
    slots = newest_slots(meta, table, page_size)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    flat_k[slots], flat_v[slots] = float("nan"), float("nan")
    for b in skip:
        slots[b] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_rot = rope_and_write_kv_reference(q, k_new, v_new, meta.positions, cos_sin, k_ref, v_ref, slots)
    ref = sink_attention_reference(q_rot, k_ref, v_ref, meta, table, sinks, scale, window)
    out = decode_with_new_kv(q, k_new, v_new, cos_sin, k_cache, v_cache, meta, table, slots, sinks, scale, window, **kw)
    keep = [b for b in range(len(lens)) if b not in skip]
    assert out.shape == ref.shape and out.dtype == q.dtype
    err = relative_error(out[keep], ref[keep])
    tol = TOL if kv_dtype is None else max(TOL, 1e-3)  # an fp8 cache's MMAs take fp16
    assert err < tol, f"relative error {err:.2e}"
    exact = dict(rtol=0, atol=0) if not CUDA else dict(rtol=8e-3, atol=1e-2)  # GPU: FMA contraction
    if k_cache.dtype == FP8_KV_DTYPE:  # a contracted FMA can round the other way: one fp8 step
        exact = dict(rtol=0.126, atol=2.0**-9)
        k_cache, k_ref, v_cache, v_ref = k_cache.float(), k_ref.float(), v_cache.float(), v_ref.float()
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **exact)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_with_new_kv(heads, window, splits):
    """RoPE and the cache write folded into the decode kernel: same output and same caches as
    the separate launches, with and without splits (the new key belongs to one split)."""
    attention_triton, _ = _kernel_modules()
    cfg = attention_triton.DecodeConfig(block_n=16, num_splits=splits)
    lens = [1, 9, 17, 23, 40]  # one key; a key past a whole block; inside and across the window
    check_decode_with_new_kv(
        attention_triton.decode_attention_with_new_kv, 13, lens, heads, 4, window, skip=(3,), decode_cfg=cfg
    )


@needs_triton
def test_triton_backend_folds_rope_only_into_decode():
    """`rope_kv_attention` of the Triton backend: a decode step through the fused kernel, anything
    else through the two launches; the reference backend composes the two. Same results."""
    attention_triton, rope_cache = _kernel_modules()
    from inference.ops.attention.backend import TritonAttentionBackend

    backend = TritonAttentionBackend()  # with the interpreted kernels on CPU:
    backend._attention = attention_triton.paged_sink_attention
    backend._rope_and_write_kv = rope_cache.rope_and_write_kv_triton
    fused = attention_triton.decode_attention_with_new_kv
    calls = []
    backend._decode_with_new_kv = lambda *a, **k: calls.append("fused") or fused(*a, **k)

    check_decode_with_new_kv(lambda *a: backend.rope_kv_attention(*a), 5, [3, 20], (4, 2, 16), 4, None)
    assert calls == ["fused"]
    check_decode_with_new_kv(
        lambda *a: ReferenceAttentionBackend().rope_kv_attention(*a), 5, [3, 20], (4, 2, 16), 4, None
    )
    # A prefill step (positions 3 and 4 of one sequence) takes the separate launches: same output
    # and caches as the reference backend's.
    q, k_cache, v_cache, meta, table, sinks, scale = make_batch(6, [2], [5], (4, 2, 16), 4, None)
    k = torch.randn(2, 2, 16).to(DTYPE).to(DEVICE)
    v = torch.randn(2, 2, 16).to(DTYPE).to(DEVICE)
    cos_sin = torch.randn(8, 16).to(DEVICE)
    slots = torch.tensor([int(table[0, 0]) * 4 + 3, int(table[0, 1]) * 4], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = ReferenceAttentionBackend().rope_kv_attention(
        q, k, v, cos_sin, k_ref, v_ref, meta, table, slots, sinks, scale, None
    )
    out = backend.rope_kv_attention(q, k, v, cos_sin, k_cache, v_cache, meta, table, slots, sinks, scale, None)
    assert calls == ["fused"]
    assert relative_error(out, ref) < TOL
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **({} if CUDA else dict(rtol=1e-6, atol=1e-6)))


@needs_triton
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 8])
def test_triton_prefill_extend(heads, window):
    attention_triton, _ = _kernel_modules()
    # A fresh prompt, an extend over a cached prefix, and a decode token, in one ragged batch.
    check_attention(
        attention_triton.paged_sink_attention,
        21,
        [19, 6, 1],
        [19, 37, 12],
        heads,
        4,
        window,
        **small_cfgs(attention_triton),
    )


@needs_triton
@pytest.mark.parametrize("window", [None, 8])
def test_triton_decode_rows_ahead_of_prompts_take_the_decode_kernel(window, monkeypatch):
    """A step where prompts join decoding sequences: the leading decode rows, in whole groups of
    4, run in the decode kernel; the rest (a fifth decode row, a prompt, an extend, a decode row
    after them, an idle sequence) in the prefill kernel; together they equal the reference.
    (The threshold of decode rows, 64 in the engine, is lowered to 4 for these small steps.)"""
    attention_triton, _ = _kernel_modules()
    monkeypatch.setattr(attention_triton, "MIXED_DECODE_MIN_ROWS", 4)
    calls = []
    for name in ("_decode", "_prefill"):
        original = getattr(attention_triton, name)

        def spy(q, *args, _name=name, _original=original, **kw):
            calls.append((_name, q.shape[0]))
            return _original(q, *args, **kw)

        monkeypatch.setattr(attention_triton, name, spy)
    q_lens, contexts = [1, 1, 1, 1, 1, 9, 6, 1, 0], [30, 12, 41, 5, 7, 9, 20, 13, 4]
    check_attention(
        attention_triton.paged_sink_attention,
        11,
        q_lens,
        contexts,
        (4, 2, 16),
        4,
        window,
        **small_cfgs(attention_triton),
    )
    assert calls == [("_decode", 4), ("_prefill", 17)]  # whole groups of 4 decode rows
    calls.clear()  # a step that starts with a prompt: all of it in the prefill kernel
    check_attention(attention_triton.paged_sink_attention, 11, [5, 1, 1], [5, 9, 17], (4, 2, 16), 4, window)
    assert calls == [("_prefill", 7)]
    calls.clear()  # fewer decode rows than the threshold: all of it in the prefill kernel
    monkeypatch.setattr(attention_triton, "MIXED_DECODE_MIN_ROWS", 8)
    check_attention(attention_triton.paged_sink_attention, 11, [1] * 7 + [5], [9] * 7 + [5], (4, 2, 16), 4, window)
    assert calls == [("_prefill", 12)]


@needs_triton
def test_a_mixed_steps_split_is_derived_once_for_all_layers(monkeypatch):
    """Every layer asks for the split of a step's leading decode rows; the slices are made once
    and kept on the step's metadata, which a new step (or a dataclasses.replace) starts without."""
    attention_triton, _ = _kernel_modules()
    monkeypatch.setattr(attention_triton, "MIXED_DECODE_MIN_ROWS", 4)
    made = []
    original = attention_triton.sequences
    monkeypatch.setattr(attention_triton, "sequences", lambda *a: made.append(a[1:]) or original(*a))
    q_lens = [1, 1, 1, 1, 1, 1, 5]
    cu = torch.tensor([0, 1, 2, 3, 4, 5, 6, 11], dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        context_lens=torch.tensor([9] * 6 + [5], dtype=torch.int32),
        block_tables={"full": torch.arange(14, dtype=torch.int32).view(7, 2)},
        slot_mapping={"full": torch.arange(11)},
        positions=torch.arange(11),
        max_q_len=5,
        q_lens=q_lens,
        context_lens_list=[9] * 6 + [5],
    )
    split = attention_triton.mixed_decode_split(meta)
    assert attention_triton.mixed_decode_split(meta) is split and made == [(0, 4), (4, 7)]
    rows, head, rest_from, rest = split
    assert rows == rest_from == 4 and head.q_lens == [1] * 4 and rest.q_lens == [1, 1, 5]
    assert rest.cu_seqlens_q.tolist() == [0, 1, 2, 7] and rest.block_tables["full"][0].tolist() == [8, 9]
    prompt_first = dataclasses.replace(meta, q_lens=[5, *q_lens[1:]])
    assert attention_triton.mixed_decode_split(prompt_first) == (0, None, 0, None)  # (not itself: no cycle)
    assert len(made) == 2


@gpu_only
def test_gpu_mixed_steps_compile_nothing_after_the_warm_up():
    """After the backend's warm-up, mixed steps at gpt-oss shapes (64 to 256 decode rows ahead of a
    prompt, block tables padded as `step_inputs.table_width` pads them, both windows) launch only decode
    kernel variants it compiled: none compiles while serving."""
    attention_triton, _ = _kernel_modules()
    from inference.ops.attention.backend import TritonAttentionBackend

    kernel = attention_triton._decode_kernel
    if not hasattr(kernel, "device_caches"):
        pytest.skip("this Triton keeps its compiled variants elsewhere")
    hq, hkv, d = GPT_OSS
    TritonAttentionBackend().warmup(hq, hkv, d, 16, (None, 128), torch.bfloat16)
    device = torch.cuda.current_device()
    compiled = len(kernel.device_caches[device][0])
    # (contexts of 14 and 94 pages: `make_batch`'s tables, 2 pages wider, are then whole 16s)
    for rows, context in ((64, 220), (68, 1500), (256, 1500), (132, 220)):
        for window in (None, 128):
            check_attention(
                attention_triton.paged_sink_attention,
                3,
                [1] * rows + [200],
                [context] * rows + [200],
                GPT_OSS,
                16,
                window,
            )
    assert len(kernel.device_caches[device][0]) == compiled


@needs_triton
@pytest.mark.parametrize("seqs_a_scan", [64, 4])
def test_triton_prefill_many_sequences(seqs_a_scan, monkeypatch):
    """Tiles find their sequence in-kernel: many sequences, some with no new tokens; with 4 a scan
    step, the search crosses steps (and a step ends on a sequence with no tiles)."""
    attention_triton, _ = _kernel_modules()
    monkeypatch.setattr(attention_triton, "PREFILL_SEQS_A_SCAN", seqs_a_scan)
    q_lens = [3, 0, 17, 1, 0, 9, 2, 16, 1, 5]
    contexts = [3, 4, 30, 22, 7, 9, 40, 16, 2, 12]
    check_attention(
        attention_triton.paged_sink_attention, 8, q_lens, contexts, (4, 2, 16), 4, 8, **small_cfgs(attention_triton)
    )


def graph_bounds(meta: AttentionMetadata, table: torch.Tensor, slots_for: int):
    """`meta` as a CUDA graph of its tokens for `slots_for` sequences sees it: (metadata whose
    lists are bounds, q_lens [Q, 1, 1, ...], with cu_seqlens_q repeating the end and contexts of
    0 past the real sequences; the block table with rows of -1 for those)."""
    total, pad = sum(meta.q_lens), slots_for - len(meta.q_lens)
    dev = meta.context_lens.device
    bound = AttentionMetadata(
        cu_seqlens_q=torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(pad)]),
        context_lens=torch.cat([meta.context_lens, torch.zeros(pad, dtype=torch.int32, device=dev)]),
        block_tables=meta.block_tables,
        slot_mapping=meta.slot_mapping,
        positions=meta.positions,
        max_q_len=total,
        q_lens=[total] + [1] * (slots_for - 1),
        context_lens_list=[64] * slots_for,
    )
    return bound, torch.cat([table, torch.full((pad, table.shape[1]), -1, dtype=table.dtype, device=dev)])


@needs_triton
def test_triton_prefill_grid_from_bounds():
    """As a CUDA graph of Q tokens for up to S sequences launches it: the metadata's lists are
    bounds (q_lens [Q, 1, 1, ...]), the device's cu_seqlens_q repeats the end past the real
    sequences. The real rows come out as with the exact grid; the tiles past them do nothing."""
    attention_triton, _ = _kernel_modules()
    q_lens, contexts, slots_for = [1, 9, 1, 3], [30, 9, 12, 20], 7
    for window in (None, 8):
        q, k_cache, v_cache, meta, table, sinks, scale = make_batch(5, q_lens, contexts, (4, 2, 16), 4, window)
        ref = sink_attention_reference(q, k_cache, v_cache, meta, table, sinks, scale, window)
        bound, wide_table = graph_bounds(meta, table, slots_for)
        out = attention_triton.paged_sink_attention(
            q, k_cache, v_cache, bound, wide_table, sinks, scale, window, **small_cfgs(attention_triton)
        )
        assert relative_error(out, ref) < TOL


@needs_triton
@pytest.mark.parametrize("q_lens, contexts", [([1, 1, 1, 9, 1, 3], [30, 12, 7, 9, 12, 20]), ([4, 1, 1], [4, 9, 17])])
def test_triton_graph_step_gives_its_decode_rows_to_the_decode_kernel(monkeypatch, q_lens, contexts):
    """A CUDA graph's step (bounds in the lists) with a `DecodePrefix`: the decode kernel takes
    the prefix's bound of rows, those past the step's real decode rows attending to nothing, and
    the prefill kernel the whole step, where those decode rows have no tokens. Every row comes
    out as the reference computes it, also where the step starts with a prompt (no decode rows)."""
    attention_triton, _ = _kernel_modules()
    from inference.ops.attention.reference import DecodePrefix, leading_decode_rows

    calls, offsets = [], []
    for name in ("_decode", "_prefill"):
        original = getattr(attention_triton, name)

        def spy(q, *args, _name=name, _original=original, **kw):
            calls.append((_name, q.shape[0]))
            offsets.append(args[2].cu_seqlens_q.tolist())
            return _original(q, *args, **kw)

        monkeypatch.setattr(attention_triton, name, spy)
    slots_for = 8
    for window in (None, 8):
        q, k_cache, v_cache, meta, table, sinks, scale = make_batch(6, q_lens, contexts, (4, 2, 16), 4, window)
        ref = sink_attention_reference(q, k_cache, v_cache, meta, table, sinks, scale, window)
        total, d = sum(q_lens), leading_decode_rows(meta)
        bound, wide_table = graph_bounds(meta, table, slots_for)
        cu = bound.cu_seqlens_q
        rows = min(total, slots_for - 1)
        # Stale lengths past the real decode rows would read keys: the prefix holds zeros there.
        decode_contexts = torch.zeros(rows, dtype=torch.int32, device=q.device)
        decode_contexts[:d] = meta.context_lens[:d]
        bound.decode_prefix = DecodePrefix(rows, decode_contexts, cu.clamp(min=d))
        calls.clear()
        offsets.clear()
        out = attention_triton.paged_sink_attention(
            q, k_cache, v_cache, bound, wide_table, sinks, scale, window, **small_cfgs(attention_triton)
        )
        assert calls == [("_decode", rows), ("_prefill", total)]
        # The prefill kernel's offsets give the decode rows no tokens (it would compute them again).
        assert offsets[1] == cu.clamp(min=d).tolist() and offsets[1][: d + 1] == [d] * (d + 1)
        assert relative_error(out, ref) < TOL


@needs_triton
def test_triton_prefill_default_tiles():
    attention_triton, _ = _kernel_modules()
    check_attention(attention_triton.paged_sink_attention, 4, [70, 3], [70, 9], (4, 1, 32), 8, 16)


@needs_triton
def test_triton_rope_and_write_kv():
    _, rope_cache = _kernel_modules()
    for seed, (hq, hkv, d) in enumerate([(6, 2, 16), (8, 1, 32)]):
        args = rope_inputs(seed, hq=hq, hkv=hkv, d=d, dtype=DTYPE, device=DEVICE)
        ref_args = [a.clone() for a in args]
        out = rope_cache.rope_and_write_kv_triton(*args)
        ref = rope_and_write_kv_reference(*ref_args)
        tol = dict(atol=1e-2, rtol=1e-2) if CUDA else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, **tol)
        torch.testing.assert_close(args[5], ref_args[5], **tol)  # k_cache
        torch.testing.assert_close(args[6], ref_args[6], **tol)  # v_cache


@needs_triton
@pytest.mark.parametrize("window", [None, 8])
def test_triton_attention_reads_fp8_caches(window):
    """Decode (split and not) and prefill/extend over fp8 caches: the kernels widen the same fp8
    keys and values the reference reads. (The fp8 writes are checked on the GPU only: Triton's
    interpreter rounds float32 to fp8 wrongly where the rounding carries into the exponent.)"""
    attention_triton, _ = _kernel_modules()
    lens = [1, 9, 17, 23, 40]
    for splits in (1, 3):
        cfg = attention_triton.DecodeConfig(block_n=16, num_splits=splits)
        check_attention(
            attention_triton.paged_sink_attention,
            31,
            [1] * 5,
            lens,
            (4, 2, 16),
            4,
            window,
            FP8_KV_DTYPE,
            decode_cfg=cfg,
        )
    check_attention(
        attention_triton.paged_sink_attention,
        32,
        [19, 6, 1],
        [19, 37, 12],
        (4, 2, 16),
        4,
        window,
        FP8_KV_DTYPE,
        **small_cfgs(attention_triton),
    )


@needs_triton
def test_triton_fp8_rounding_in_float32_matches_torch():
    """`as_cached`, the decode kernel's e4m3 rounding done in float32 (for the step's own new key
    and value), gives the value torch's cast stores: every normal binade, the subnormals, ties,
    saturation, signed zero."""
    global _AS_CACHED  # (a jitted function reaches other jitted ones through its globals)
    _, rope_cache = _kernel_modules()
    import triton
    import triton.language as tl

    _AS_CACHED = rope_cache.as_cached

    @triton.jit
    def as_cached(X, Out, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Out + i, _AS_CACHED(tl.load(X + i), Out, True))

    gen = torch.Generator().manual_seed(0)
    scales = 2.0 ** torch.randint(-14, 10, (4096,), generator=gen).float()
    x = torch.randn(4096, generator=gen) * scales
    grid = torch.tensor([1.0, 1.0625, 1.1875, 1.3125, 2.0**-7 * 1.5, 2.0**-10, 3 * 2.0**-10, 464.0, 470.0, 1e9, -0.0])
    x = torch.cat([x, grid, -grid])
    x = torch.cat([x, torch.zeros(8192 - len(x))]).to(DEVICE)
    out = torch.empty_like(x)
    as_cached[(1,)](x, out, N=8192)
    want = cache_values(x, FP8_KV_DTYPE).float()
    assert torch.equal(out, want), (x[out != want][:8], out[out != want][:8], want[out != want][:8])


# ----------------------------------------------------------------------------- GPU: real shapes

GPT_OSS = (64, 8, 64)


@gpu_only
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_gpu_decode_gpt_oss_shapes(batch, window, page_size):
    attention_triton, _ = _kernel_modules()
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    lens[0] = 129  # just across the window
    check_attention(attention_triton.paged_sink_attention, batch, [1] * batch, lens, GPT_OSS, page_size, window)


@gpu_only
@pytest.mark.parametrize("heads", [(64, 8, 16), (16, 2, 32), (24, 8, 128), (8, 8, 64)])
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_head_dims_and_groups(heads, window):
    attention_triton, _ = _kernel_modules()
    check_attention(attention_triton.paged_sink_attention, 1, [1] * 5, [1, 100, 129, 1000, 4097], heads, 16, window)
    check_attention(attention_triton.paged_sink_attention, 2, [300, 1, 77], [300, 500, 1077], heads, 16, window)


@gpu_only
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_prefill_extend_gpt_oss_shapes(window, page_size):
    attention_triton, _ = _kernel_modules()
    check_attention(
        attention_triton.paged_sink_attention, 7, [2000, 1, 333, 50], [2000, 900, 1500, 50], GPT_OSS, page_size, window
    )
    # 256 decode rows at long contexts ahead of a 1,024-token prompt (decode and prefill kernels)
    check_attention(
        attention_triton.paged_sink_attention, 9, [1] * 256 + [1024], [1500] * 256 + [1024], GPT_OSS, page_size, window
    )
    gen = torch.Generator().manual_seed(page_size)
    q_lens = torch.randint(0, 60, (70,), generator=gen).tolist()  # a mixed batch, some sequences idle
    contexts = [n + int(torch.randint(0, 700, (1,), generator=gen)) for n in q_lens]
    check_attention(attention_triton.paged_sink_attention, 8, q_lens, contexts, GPT_OSS, page_size, window)


@gpu_only
def test_gpu_prefill_compiles_once_for_any_batch():
    """Mixed steps differ in their number of sequences and block-table width from one to the next;
    none of that may compile a variant of the prefill kernel while serving."""
    attention_triton, _ = _kernel_modules()
    kernel = attention_triton._prefill_kernel
    check_attention(attention_triton.paged_sink_attention, 30, [5, 1], [40, 3], GPT_OSS, 16, None)
    compiled = len(kernel.device_caches[torch.cuda.current_device()][0])
    gen = torch.Generator().manual_seed(3)
    for b, seqs in enumerate([2, 3, 16, 17, 33, 64, 65, 130]):
        q_lens = [1] * (seqs - 1) + [int(torch.randint(2, 40, (1,), generator=gen))]
        contexts = [n + int(torch.randint(0, 16 * (b + 1) ** 2, (1,), generator=gen)) for n in q_lens]
        check_attention(attention_triton.paged_sink_attention, 31 + b, q_lens, contexts, GPT_OSS, 16, None)
    assert len(kernel.device_caches[torch.cuda.current_device()][0]) == compiled


@gpu_only
def test_gpu_decode_under_cuda_graph():
    """Captured once with upper-bound lengths, replayed on other lengths: still exact."""
    attention_triton, _ = _kernel_modules()
    batch = 8
    q, k_cache, v_cache, meta, table, sinks, scale = make_batch(0, [1] * batch, [4000] * batch, GPT_OSS, 16, None)
    lens = meta.context_lens.clone()
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention_triton.paged_sink_attention(q, k_cache, v_cache, meta, table, sinks, scale, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(attention_triton.paged_sink_attention(q, k_cache, v_cache, meta, table, sinks, scale, None))
    new_lens = torch.tensor([1, 17, 128, 129, 999, 2048, 3001, 4000], dtype=torch.int32, device=DEVICE)
    meta.context_lens.copy_(new_lens)
    q.copy_(torch.randn_like(q))
    graph.replay()
    meta_now = AttentionMetadata(
        cu_seqlens_q=meta.cu_seqlens_q,
        context_lens=new_lens,
        block_tables=meta.block_tables,
        slot_mapping=meta.slot_mapping,
        positions=new_lens.long() - 1,
        max_q_len=1,
        q_lens=[1] * batch,
        context_lens_list=new_lens.tolist(),
    )
    ref = sink_attention_reference(q, k_cache, v_cache, meta_now, table, sinks, scale, None)
    assert relative_error(out, ref) < TOL
    meta.context_lens.copy_(lens)


@gpu_only
def test_gpu_rope_and_write_kv_gpt_oss_shapes():
    _, rope_cache = _kernel_modules()
    args = rope_inputs(9, t=300, hq=64, hkv=8, d=64, page_size=16, num_pages=40, dtype=torch.bfloat16, device=DEVICE)
    ref_args = [a.clone() for a in args]
    out = rope_cache.rope_and_write_kv_triton(*args)
    ref = rope_and_write_kv_reference(*ref_args)
    for got, want in ((out, ref), (args[5], ref_args[5]), (args[6], ref_args[6])):
        assert relative_error(got, want) < 1e-2


@gpu_only
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_fp8_caches_gpt_oss_shapes(window):
    """fp8 caches at gpt-oss's shapes: decode at batch 1-7 and at 256 sequences (the serving
    launch shape), 256 decode rows beside a 1,024-token prompt, and the fused RoPE + write."""
    attention_triton, _ = _kernel_modules()
    fp8 = FP8_KV_DTYPE
    paged = attention_triton.paged_sink_attention
    check_attention(paged, 3, [1] * 7, [129, 1000, 3000, 1, 2048, 17, 700], GPT_OSS, 16, window, fp8)
    check_attention(paged, 4, [1] * 256, [1500] * 256, GPT_OSS, 16, window, fp8)
    check_attention(paged, 5, [1] * 256 + [1024], [1500] * 256 + [1024], GPT_OSS, 16, window, fp8)
    for splits in (None, 1):
        cfg = attention_triton.DecodeConfig(num_splits=splits)
        check_decode_with_new_kv(
            attention_triton.decode_attention_with_new_kv,
            17,
            [1, 129, 1000, 2500],
            GPT_OSS,
            16,
            window,
            skip=(2,),
            kv_dtype=fp8,
            decode_cfg=cfg,
        )


@gpu_only
def test_gpu_fp8_rope_and_write_kv():
    """The separate RoPE + write launch (prefill steps) into fp8 caches, keys large enough to
    saturate: within one fp8 step of the reference (a contracted FMA), values exact."""
    _, rope_cache = _kernel_modules()
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = rope_inputs(
        9, t=300, hq=64, hkv=8, d=64, page_size=16, num_pages=40, dtype=torch.bfloat16, device=DEVICE
    )
    k = k * 300
    args = [q, k, v, positions, cos_sin, k_cache.to(FP8_KV_DTYPE), v_cache.to(FP8_KV_DTYPE), slots]
    ref_args = [a.clone() for a in args]
    out = rope_cache.rope_and_write_kv_triton(*args)
    ref = rope_and_write_kv_reference(*ref_args)
    assert relative_error(out, ref) < 1e-2
    assert args[5].float().abs().max() == 448.0
    torch.testing.assert_close(args[5].float(), ref_args[5].float(), rtol=0.126, atol=2.0**-9)
    torch.testing.assert_close(args[6].float(), ref_args[6].float(), rtol=0, atol=0)


@needs_triton
@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_poisoned_cache_catches_reads_outside_the_window():
    """The checks above can fail: attending over a sliding batch as if it were full reads freed
    pages and out-of-window entries, and the output turns NaN."""
    attention_triton, _ = _kernel_modules()
    q, k_cache, v_cache, meta, table, sinks, scale = make_batch(2, [1, 3], [40, 40], (4, 2, 16), 4, 8)
    out = attention_triton.paged_sink_attention(
        q, k_cache, v_cache, meta, table, sinks, scale, None, **small_cfgs(attention_triton)
    )
    assert not torch.isfinite(out).all()


# ----------------------------------------------------------------------------- flashinfer
# The page layout handed to flashinfer is checked on CPU against the reference by replaying
# flashinfer's documented semantics (CSR pages, last-page length, causal mask and window_left on
# positions relative to the listed keys); the kernels themselves run on a GPU with flashinfer.

from inference.ops.attention.flashinfer import paged_layout  # noqa: E402


def attention_over_listed_pages(q, k_cache, v_cache, layout, pages, sinks, scale, window_left):
    """flashinfer's paged attention semantics, in float64: sequence b's keys are the slots of its
    listed pages (the last one cut to last_page_len); query i of n new ones sits at key position
    kv_len - n + i and sees key j when j <= it and (window_left < 0 or it - j <= window_left)."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    page_size = k_cache.shape[1]
    for b in range(len(layout.last_page_len)):
        p0, p1 = int(layout.kv_indptr[b]), int(layout.kv_indptr[b + 1])
        q0, q1 = int(layout.qo_indptr[b]), int(layout.qo_indptr[b + 1])
        if q0 == q1:
            continue
        seq_pages = pages[p0:p1].long()
        keys = k_cache[seq_pages].reshape(-1, hkv, k_cache.shape[-1])
        values = v_cache[seq_pages].reshape(-1, hkv, v_cache.shape[-1])
        kv_len = (p1 - p0 - 1) * page_size + int(layout.last_page_len[b])
        keys, values = keys[:kv_len].double(), values[:kv_len].double()
        for i in range(q1 - q0):
            pos = kv_len - (q1 - q0) + i
            first = 0 if window_left < 0 else max(0, pos - window_left)
            for h in range(hq):
                kv = h // (hq // hkv)
                s = keys[first : pos + 1, kv] @ q[q0 + i, h].double() * scale
                p = torch.softmax(torch.cat([s, sinks[h : h + 1].double()]), 0)[:-1]
                out[q0 + i, h] = p @ values[first : pos + 1, kv]
    return out


@pytest.mark.parametrize("window", [None, 8])
def test_flashinfer_page_layout_reproduces_the_reference(window):
    """Full layers list every page; sliding layers drop whole pages below the window (freed, -1)
    and shift positions, which leaves the masks unchanged; window_left is window - 1."""
    q_lens, contexts, page_size = [1, 1, 5, 19, 2, 1], [1, 40, 23, 19, 9, 17], 4
    q, k_cache, v_cache, meta, table, sinks, scale = make_batch(
        31, q_lens, contexts, (4, 2, 8), page_size, window, dtype=torch.float32, device="cpu", whole_pages=True
    )
    layout = paged_layout(q_lens, contexts, page_size, window, table.shape[1])
    pages = table.reshape(-1)[layout.table_index]
    assert bool((pages >= 0).all()), "a freed page was listed"
    assert layout.qo_indptr.tolist() == meta.cu_seqlens_q.tolist()
    assert bool(((layout.last_page_len >= 1) & (layout.last_page_len <= page_size)).all())
    if window is not None:  # the long sequence keeps only the pages its window reaches
        assert int(layout.kv_indptr[2] - layout.kv_indptr[1]) == 2  # keys 32..39 of 40
    out = attention_over_listed_pages(
        q, k_cache, v_cache, layout, pages, sinks, scale, -1 if window is None else window - 1
    )
    ref = sink_attention_reference(q, k_cache, v_cache, meta, table, sinks, scale, window)
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=1e-5)
    # The mapping is not vacuous: window_left = window (one key too many) gives another answer.
    if window is not None:
        wider = attention_over_listed_pages(q, k_cache, v_cache, layout, pages, sinks, scale, window)
        assert (wider.float() - ref).abs().max() > 1e-3


def test_flashinfer_backend_falls_back_to_triton_where_it_cannot_build():
    """Head sizes flashinfer has no kernels for never reach it, and a failed build leaves the
    backend serving every step on Triton instead of failing the engine."""
    from inference.ops.attention.backend import FlashInferAttentionBackend

    class FailingBuild:
        calls = 0

        def warmup(self, *args):
            FailingBuild.calls += 1
            raise RuntimeError("nvcc failed")

    backend = FlashInferAttentionBackend.__new__(FlashInferAttentionBackend)
    backend.flashinfer, backend.enabled = FailingBuild(), True
    big = backend.FLASHINFER_MIN_TOKENS
    meta = AttentionMetadata(
        cu_seqlens_q=None,
        context_lens=None,
        block_tables={},
        slot_mapping={},
        positions=None,
        max_q_len=big,
        q_lens=[big],
        context_lens_list=[big],
    )
    assert backend.runs_flashinfer(torch.empty(big, 8, 64, dtype=torch.bfloat16), meta, None)
    assert not backend.runs_flashinfer(torch.empty(big, 8, 16, dtype=torch.bfloat16), meta, None)
    backend.warmup(8, 2, 16, 16, (None, 128), torch.bfloat16)  # head size 16: nothing to build
    assert FailingBuild.calls == 0 and backend.enabled
    backend.warmup(8, 2, 64, 16, (None, 128), torch.bfloat16)
    assert FailingBuild.calls == 1 and not backend.enabled
    assert not backend.runs_flashinfer(torch.empty(big, 8, 64, dtype=torch.bfloat16), meta, None)


def test_flashinfer_backend_needs_a_gpu():
    with pytest.raises(RuntimeError, match="flashinfer"):
        select_attention_backend("cpu", "flashinfer")


def _flashinfer_kernels() -> list[str]:
    if not CUDA:
        return []
    from inference.ops.attention.flashinfer import flashinfer_available

    if not flashinfer_available(DEVICE):
        return []
    return ["fa2", "fa3"] if torch.cuda.get_device_capability()[0] == 9 else ["fa2"]


needs_flashinfer = pytest.mark.skipif(not _flashinfer_kernels(), reason="needs a CUDA GPU with flashinfer-python")


@pytest.fixture(scope="module")
def flashinfer_kernels():
    from inference.ops.attention.flashinfer import FlashInferAttention

    return {name: FlashInferAttention(DEVICE, name) for name in _flashinfer_kernels()}


@needs_flashinfer
@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("page_size", [16, 32])
def test_gpu_flashinfer_matches_reference(flashinfer_kernels, kernel, window, page_size):
    if kernel not in flashinfer_kernels:
        pytest.skip(f"{kernel} does not run on this GPU")
    run = flashinfer_kernels[kernel].attention
    # Prefill, extend over a cached prefix, decode rows; inside and across the window.
    cases = [
        ([2000, 1, 333, 50], [2000, 900, 1500, 50]),
        ([1] * 9, [1, 17, 127, 128, 129, 130, 1000, 2049, 4097]),
        ([300, 7, 129], [300, 135, 129]),
    ]
    gen = torch.Generator().manual_seed(page_size)
    q_lens = torch.randint(1, 60, (40,), generator=gen).tolist()
    cases.append((q_lens, [n + int(torch.randint(0, 700, (1,), generator=gen)) for n in q_lens]))
    for seed, (q_lens, contexts) in enumerate(cases):
        q, k_cache, v_cache, meta, table, sinks, scale = make_batch(
            seed, q_lens, contexts, GPT_OSS, page_size, window, whole_pages=True
        )
        ref = sink_attention_reference(q, k_cache, v_cache, meta, table, sinks, scale, window)
        out = run(q, k_cache, v_cache, meta, table, sinks, scale, window)
        err = relative_error(out, ref)
        assert err < TOL, f"{kernel} window={window} case {seed}: relative error {err:.2e}"


@needs_flashinfer
def test_gpu_flashinfer_backend_routes_by_step():
    """Full layers of big prefill steps run flashinfer; decode, small steps, sliding layers and
    graph captures run Triton; every route agrees with the reference."""
    backend = select_attention_backend(DEVICE)
    assert backend.name == "flashinfer"
    backend.FLASHINFER_MIN_TOKENS = big = 700  # the rule, at a size the float32 reference handles quickly
    cases = [
        ([big, 3], [big, 40], None, True),
        ([big, 3], [big, 40], 128, False),
        ([1, 1, 1], [5, 300, 129], None, False),
        ([9, 1], [20, 300], None, False),
    ]
    for q_lens, contexts, window, expect in cases:
        q, k_cache, v_cache, meta, table, sinks, scale = make_batch(
            3, q_lens, contexts, GPT_OSS, 16, window, whole_pages=True
        )
        assert backend.runs_flashinfer(q, meta, window) is expect
        ref = sink_attention_reference(q, k_cache, v_cache, meta, table, sinks, scale, window)
        assert relative_error(backend.attention(q, k_cache, v_cache, meta, table, sinks, scale, window), ref) < TOL
    q, *_, meta = make_batch(3, [big], [big], GPT_OSS, 16, None)[:4]
    assert backend.runs_flashinfer(q, meta, None)
    assert not backend.runs_flashinfer(q.float(), meta, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not backend.runs_flashinfer(q, meta, None)
