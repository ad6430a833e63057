"""GPU MoE path: Triton MXFP4 expert kernels and the backend choice vs the float32 reference.

On a CUDA machine the kernels run for real (bf16 activations, real gpt-oss shapes too). Without
CUDA they run under Triton's interpreter (TRITON_INTERPRET=1, float32, tiny shapes); without
Triton those tests skip and only the reference-path tests run.

The reference for a bf16 input is `moe_reference` on the same values in float32 (router
included), so both sides pick the same experts; ties between router logits are then as unlikely
as in float32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference.ops.moe.backend import ReferenceMoEBackend, select_moe_backend  # noqa: E402
from inference.ops.moe.reference import ExpertWeights, MoEWeights, moe_reference, route  # noqa: E402
from inference.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from tests.moe_layers import random_mxfp4_layer  # noqa: E402
from tests.triton_interpreter import (  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)
    CUDA,
    DEVICE,
    DTYPE,
    HAVE_TRITON,
    fresh_process_only,
    gpu_only,
    kernel_module,
    needs_triton,
    run_in_fresh_interpreter,
)

LIMIT = 7.0


def _kernels():
    """The Triton module, interpreted on CPU."""
    return kernel_module("inference.ops.moe.triton", "_route_top_k_kernel")


@pytest.mark.slow  # (over a minute on 2 cores even without the tests marked slow)
@fresh_process_only
def test_triton_in_fresh_interpreter():
    """Run this file's Triton tests in a new interpreter-mode process, all of them."""
    run_in_fresh_interpreter(__file__, marks="slow or not slow")


# ----------------------------------------------------------------------------- weights


def make_weights(
    num_experts: int, hidden: int, inter: int, seed: int = 0, device=DEVICE, weight_scale: float = 0.05
) -> MoEWeights:
    """Random MXFP4 MoE weights (router in DTYPE, like a loaded model's)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * weight_scale
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * weight_scale
    b1, s1 = quantize_mxfp4(w1)
    b2, s2 = quantize_mxfp4(w2)
    experts = ExpertWeights(
        gate_up_bias=torch.randn(num_experts, 2 * inter, generator=g) * 0.1,
        down_bias=torch.randn(num_experts, hidden, generator=g) * 0.1,
        gate_up_blocks=b1,
        gate_up_scales=s1,
        down_blocks=b2,
        down_scales=s2,
    )
    experts = ExpertWeights(
        **{f.name: t.to(device) for f in dataclasses.fields(experts) if (t := getattr(experts, f.name)) is not None}
    )
    router = (torch.randn(num_experts, hidden, generator=g) * hidden**-0.5).to(device, DTYPE)
    return MoEWeights(
        router_weight=router,
        router_bias=(torch.randn(num_experts, generator=g) * 0.1).to(device, DTYPE),
        experts=experts,
    )


def random_packed_weights(num_experts: int, hidden: int, inter: int, seed: int = 0) -> MoEWeights:
    """Real-size weights made directly on the device (router in the tests' dtype)."""
    return random_mxfp4_layer(num_experts, hidden, inter, seed, DEVICE, router_dtype=DTYPE, bias_std=0.05)


def float_copy(w: MoEWeights) -> MoEWeights:
    """The same weights with a float32 router (the reference's routing in float32)."""
    return dataclasses.replace(w, router_weight=w.router_weight.float(), router_bias=w.router_bias.float())


def reference(x: torch.Tensor, w: MoEWeights, top_k: int) -> torch.Tensor:
    return moe_reference(x.float(), float_copy(w), top_k, LIMIT)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.shape == ref.shape and out.dtype in (torch.bfloat16, torch.float32)
    assert torch.isfinite(out).all()
    scale = ref.abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} vs output scale {scale:.3g}"


def triton_backend(config=None):
    from inference.ops.moe.backend import TritonMoEBackend

    backend = TritonMoEBackend.__new__(TritonMoEBackend)
    backend._kernels = _kernels()
    backend.config = config or backend._kernels.DEFAULT_CONFIG
    return backend


def prepared_copy(backend, w: MoEWeights):
    """prepare() releases the packed tensors it is given, so hand it a shallow copy."""
    return backend.prepare(dataclasses.replace(w, experts=dataclasses.replace(w.experts)))


TOL = 2e-2 if CUDA else 1e-5
# The decode GEMVs store activations in fp16 (11 significant bits; x is bf16 on a GPU, so there
# the SwiGLU output rounds, and the fp16 partial sums): float32 inputs under the interpreter
# differ from the reference by up to ~2^-12 relative. A layout or scale mistake is off by order 1.
DECODE_TOL = TOL if CUDA else 1e-3


# ----------------------------------------------------------------------------- reference path


def test_select_backend():
    assert isinstance(select_moe_backend("cpu"), ReferenceMoEBackend)
    assert isinstance(select_moe_backend("cpu", "reference"), ReferenceMoEBackend)
    with pytest.raises(ValueError):
        select_moe_backend("cpu", "cutlass")
    if not CUDA:
        with pytest.raises(RuntimeError):
            select_moe_backend("cpu", "triton")
    elif HAVE_TRITON:
        assert select_moe_backend("cuda").name == "triton"


def test_reference_backend_packed_equals_dense():
    """Dequantised-dense experts and packed ones give the same block output."""
    w = make_weights(6, 64, 32, seed=1, device="cpu")
    w = float_copy(w)
    ex = w.experts
    dense = ExpertWeights(
        gate_up_bias=ex.gate_up_bias,
        down_bias=ex.down_bias,
        gate_up=dequantize_mxfp4(ex.gate_up_blocks, ex.gate_up_scales, torch.float32).transpose(1, 2),
        down=dequantize_mxfp4(ex.down_blocks, ex.down_scales, torch.float32).transpose(1, 2),
    )
    x = torch.randn(9, 64)
    backend = ReferenceMoEBackend()
    packed_out = backend.forward(x, backend.prepare(w), 3, LIMIT)
    dense_out = backend.forward(x, backend.prepare(dataclasses.replace(w, experts=dense)), 3, LIMIT)
    torch.testing.assert_close(packed_out, dense_out, rtol=1e-5, atol=1e-5)
    # Each token's output is its routing-weighted sum of its experts: spot-check token 0.
    ids, gates = route(x[:1], w, 3)
    y = torch.zeros(64)
    for e, g in zip(ids[0].tolist(), gates[0].tolist()):
        w1, w2 = ex.expert_matrices(e)
        h = x[0] @ w1 + ex.gate_up_bias[e]
        gate, up = h[0::2].clamp(max=LIMIT), h[1::2].clamp(-LIMIT, LIMIT)
        y += g * (((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w2 + ex.down_bias[e])
    torch.testing.assert_close(packed_out[0], y, rtol=1e-5, atol=1e-5)


def expert_share(w: MoEWeights, first: int, count: int) -> MoEWeights:
    """Experts [first, first + count) of w, as an expert-parallel rank holds them (the router whole)."""
    ex = w.experts
    part = ExpertWeights(
        **{f.name: t[first : first + count] for f in dataclasses.fields(ex) if (t := getattr(ex, f.name)) is not None}
    )
    return dataclasses.replace(w, experts=part, expert_offset=first)


def test_reference_expert_shares_sum_to_the_block():
    """Expert parallelism on the reference path: each rank's share (its experts' contributions to
    the tokens routed to them, nothing for the others) sums over the ranks to the whole block."""
    w = float_copy(make_weights(8, 64, 32, seed=2, device="cpu"))
    x = torch.randn(11, 64)
    backend = ReferenceMoEBackend()
    whole = backend.forward(x, backend.prepare(w), 3, LIMIT)
    for ranks in (2, 4):
        shares = [
            backend.forward(x, backend.prepare(expert_share(w, r * 8 // ranks, 8 // ranks)), 3, LIMIT)
            for r in range(ranks)
        ]
        assert all(share.abs().sum() > 0 for share in shares)
        torch.testing.assert_close(sum(shares), whole, rtol=1e-5, atol=1e-5)
    # A token whose experts are all elsewhere gets exactly nothing from this rank.
    ids, _ = route(x, w, 3)
    share0 = backend.forward(x, backend.prepare(expert_share(w, 0, 2)), 3, LIMIT)
    none_here = ~((ids == 0) | (ids == 1)).any(dim=1)
    assert none_here.any() and not share0[none_here].any()


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_row_group_layout_round_trip():
    """The kernels' layout holds exactly the checkpoint's values (decoded here in torch): each
    row's tile pairs in its group's chunks, gate_up's gates and ups side by side, and the
    scale words' bytes in tile order."""
    from inference.ops.moe.triton import pack_row_groups

    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    g = torch.Generator().manual_seed(2)

    def decode(w, s):  # [E, G, P, R, 64], [E, G, P, R] -> values [E, G, R, 4P * 32]
        b = w.long()
        low = lut[(b >> 1) & 7] * (1 - 2 * (b & 1))
        high = lut[b >> 5] * (1 - 2 * ((b >> 4) & 1))
        e, groups, pairs, r = s.shape
        tiles = (e, groups, pairs, r, 2, 32)
        halves = torch.stack((low.view(tiles), high.view(tiles)), dim=5)  # [E, G, P, R, tile, half, 32]
        scale_bytes = s.contiguous().view(torch.uint8).view(e, groups, pairs, r, 2, 2).float()
        halves = halves * torch.exp2(scale_bytes - 127).unsqueeze(-1)
        return halves.permute(0, 1, 3, 2, 4, 5, 6).reshape(e, groups, r, -1)

    for blocks_per_row in (4, 3, 6):  # 3: the pair padded with a zero block; 6: one pair half empty
        blocks = torch.randint(0, 256, (2, 16, blocks_per_row, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(110, 140, (2, 16, blocks_per_row), generator=g, dtype=torch.uint8)
        want = dequantize_mxfp4(blocks, scales, torch.float32)  # [2, 16, B * 32]
        pairs = -(-blocks_per_row // 4)
        w, s = pack_row_groups(blocks, scales)
        assert w.shape == (2, 2, pairs, 8, 64) and s.shape == (2, 2, pairs, 8) and s.dtype == torch.int32
        got = decode(w, s).reshape(2, 16, -1)
        assert torch.equal(got[..., : blocks_per_row * 32], want)
        assert (got[..., blocks_per_row * 32 :] == 0).all()
        # gate_up: rows reordered, then 8 gates and their 8 ups a group
        rows = torch.randperm(16, generator=g)
        w, s = pack_row_groups(blocks, scales, rows, parts=2)
        assert w.shape == (2, 1, pairs, 16, 64)
        got = decode(w, s).reshape(2, 16, -1)[..., : blocks_per_row * 32]
        assert torch.equal(got, want[:, rows])
    with pytest.raises(ValueError, match="whole 8-row groups"):
        pack_row_groups(blocks[:, :8], scales[:, :8], parts=2)


def _run_ptx(text: str, operands: list[int]) -> dict:
    """Execute the few PTX instructions the MoE kernels' inline assembly uses, with IEEE
    semantics (fp16 and bf16 math: exact in float64, then one rounding, subnormals kept).
    operands: $2.. as unsigned integers; returns the registers ($0, $1 are the results)."""
    import numpy as np

    regs = {f"${i + 2}": np.uint32(v) for i, v in enumerate(operands)}

    def val(tok):
        return np.uint32(int(tok, 16)) if tok.startswith("0x") else regs[tok]

    def halves(v):
        return np.array([v], dtype=np.uint32).view(np.float16).astype(np.float64)

    def pack(pair):
        return np.asarray(pair, dtype=np.float16).view(np.uint32)[0]

    for line in text.strip().splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith("//"):
            continue
        op, args = line.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "mov.b32":  # mov.b32 {lo, hi}, x
            lo, hi = a[0].strip("{ "), a[1].strip("} ")
            regs[lo], regs[hi] = halves(val(a[2]))
        elif op == "shl.b32":
            regs[a[0]] = np.uint32((int(val(a[1])) << int(a[2])) & 0xFFFFFFFF)
        elif op == "shr.b32":
            regs[a[0]] = np.uint32(int(val(a[1])) >> int(a[2]))
        elif op == "and.b32":
            regs[a[0]] = np.uint32(int(val(a[1])) & int(val(a[2])))
        elif op == "or.b32":
            regs[a[0]] = np.uint32(int(val(a[1])) | int(val(a[2])))
        elif op == "cvt.u32.u16":
            regs[a[0]] = np.uint32(int(val(a[1])) & 0xFFFF)
        elif op == "prmt.b32":  # bytes of {b, a} picked by the selector's nibbles (no sign mode)
            src = int(val(a[1])) | int(val(a[2]) if a[2] != "0" else 0) << 32
            sel = int(val(a[3]))
            assert all((sel >> (4 * i)) & 8 == 0 for i in range(4))
            regs[a[0]] = np.uint32(sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4)))
        elif op == "mul.rn.bf16x2":
            x, y = (
                torch.tensor([int(val(t))], dtype=torch.int64).to(torch.int32).view(torch.bfloat16).double()
                for t in a[1:3]
            )
            regs[a[0]] = np.uint32(int((x * y).to(torch.bfloat16).view(torch.int32).item()) & 0xFFFFFFFF)
        elif op == "mul.lo.u32":
            regs[a[0]] = np.uint32((int(val(a[1])) * int(val(a[2]))) & 0xFFFFFFFF)
        elif op == "mul.rn.f16x2":
            regs[a[0]] = pack(halves(val(a[1])) * halves(val(a[2])))
        elif op == "fma.rn.f16x2":
            regs[a[0]] = pack(halves(val(a[1])) * halves(val(a[2])) + halves(val(a[3])))
        elif op == "cvt.f32.f16":
            regs[a[0]] = np.float32(regs[a[1]])
        elif op == "add.f32":
            regs[a[0]] = np.float32(regs[a[1]] + regs[a[2]])
        else:
            raise AssertionError(f"unknown instruction {op}")
    return regs


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_word_pair_dot_assembly_decodes_the_planar_layout():
    """The decode GEMVs' inline assembly, executed instruction by instruction on CPU: for two
    (or four) words of a tile it returns the sums over their low values (one scale block) and
    their high values (the next) against fp16 activations in the `_permuted` order, in units of
    e2m1 * 2^-14."""
    import numpy as np

    from inference.ops.moe.triton import WORD_PAIR_DOT_PTX, WORD_QUAD_DOT_PTX, planar_tiles

    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    g = torch.Generator().manual_seed(12)
    blocks = torch.randint(0, 256, (1, 1, 2, 16), generator=g, dtype=torch.uint8)
    w = planar_tiles(blocks, 2)
    words = w.view(torch.int32).view(-1).numpy().view(np.uint32)  # the tile's 8 words
    values = dequantize_mxfp4(blocks, torch.full((1, 1, 2), 127, dtype=torch.uint8), torch.float64).view(-1)
    assert set(lut.tolist()) >= set(values.abs().tolist())
    x = (torch.randn(64, generator=g, dtype=torch.float64) * 1000).to(torch.float16)
    perm = torch.tensor([0, 2, 1, 3]).repeat(16) + torch.arange(64) // 4 * 4
    x_perm = torch.empty_like(x)
    x_perm[perm] = x
    x32 = x_perm.view(torch.int32).numpy().view(np.uint32)
    xs = x.double()

    def pair_x(i):  # word pair i's activation operands (x32 index 4i: natural index 8i)
        b = 4 * i
        return [x32[b], x32[b + 1], x32[b + 16], x32[b + 17], x32[b + 2], x32[b + 3], x32[b + 18], x32[b + 19]]

    def check(ptx, first_word, count, key):  # `count` words from `first_word`: values 4 * first_word..
        ops = list(words[first_word : first_word + count])
        for i in range(first_word // 2, (first_word + count) // 2):
            ops += pair_x(i)
        regs = _run_ptx(ptx, [int(o) for o in ops])
        got_lo, got_hi = float(regs["$0"]), float(regs["$1"])
        lo = slice(4 * first_word, 4 * (first_word + count))
        hi = slice(32 + 4 * first_word, 32 + 4 * (first_word + count))
        want_lo = (values[lo] * xs[lo]).sum().item() * 2**-14
        want_hi = (values[hi] * xs[hi]).sum().item() * 2**-14
        scale = (values.abs() * xs.abs()).max().item() * 2**-14 * 4 * count
        assert abs(got_lo - want_lo) <= 2e-3 * scale, (key, got_lo, want_lo)
        assert abs(got_hi - want_hi) <= 2e-3 * scale, (key, got_hi, want_hi)

    for i in range(4):  # word pair i: words 2i, 2i+1; low values 8i..8i+7, high values 32+8i..
        check(WORD_PAIR_DOT_PTX, 2 * i, 2, ("pair", i))
    for j in range(2):  # quad j (what the GEMVs run): word pairs 2j and 2j+1, values 16j..16j+15
        check(WORD_QUAD_DOT_PTX, 4 * j, 4, ("quad", j))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_grouped_dequant_assembly_decodes_the_planar_layout():
    """The grouped GEMMs' inline assembly, executed instruction by instruction on CPU: two bytes
    of a tile (two K-adjacent operand elements) and their blocks' bf16 multipliers give exactly
    the checkpoint's low values (one scale block) and high values (the next), as bf16 pairs."""
    from inference.ops.moe.triton import GROUPED_DEQUANT_PTX, planar_tiles

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (1, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.tensor([[[1, 60], [117, 118], [119, 120], [121, 122], [126, 127], [128, 100]]], dtype=torch.uint8)
    w = planar_tiles(blocks, 2).view(1, 6, 32)
    values = dequantize_mxfp4(blocks, scales, torch.float64)  # [1, 6, 64]

    def bf16_bits(v: float) -> int:
        return int(torch.tensor([v], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF

    for row in range(6):
        mult_lo, mult_hi = (bf16_bits(2.0 ** (int(scales[0, row, b]) - 1)) for b in (0, 1))
        for j in range(0, 32, 2):
            two_bytes = int(w[0, row, j]) | int(w[0, row, j + 1]) << 8  # elements j, j+1
            regs = _run_ptx(GROUPED_DEQUANT_PTX, [two_bytes, mult_lo | mult_lo << 16, mult_hi | mult_hi << 16])
            for reg, first in (("$0", j), ("$1", 32 + j)):
                got = torch.tensor([int(regs[reg])], dtype=torch.int64).to(torch.int32).view(torch.bfloat16).double()
                assert torch.equal(got, values[0, row, first : first + 2]), (row, j, reg)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_gemv_activation_scale_bounds_the_swiglu():
    """The power of two the decode GEMVs store the SwiGLU output under keeps every clamped
    SwiGLU value inside fp16 and uses at least half the headroom; limits that bound nothing,
    or too much for fp16's range, get None."""
    from inference.ops.moe.reference import swiglu
    from inference.ops.moe.triton import FP16_ACTIVATION_MAX, gemv_activation_scale

    for limit in (7.0, 1.0, 0.25, 50.0):
        scale = gemv_activation_scale(limit)
        grid = torch.linspace(-3 * limit - 10, 3 * limit + 10, 2001, dtype=torch.float64)
        h = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), dim=-1).reshape(-1, 2)  # (gate, up)
        biggest = swiglu(h, limit).abs().max().item()
        assert scale * biggest <= FP16_ACTIVATION_MAX < 65504, limit
        assert scale * max(limit, 0.3) * (limit + 1) > FP16_ACTIVATION_MAX / 2, limit
    for limit in (float("inf"), float("nan"), 0.0, -1.0, 100.0):
        assert gemv_activation_scale(limit) is None, limit


@needs_triton
def test_triton_output_dtype():
    """Both paths hand back their float32 sums when asked (the model's residual add takes them
    as they are), and cast to any other dtype asked for."""
    w = make_weights(4, 64, 64, seed=15)
    x = torch.randn(1, 64, device=DEVICE).to(DTYPE)  # (one token: the cast does not depend on how many)
    ref = reference(x, w, 2)
    for decode_max in (1, 0):
        backend = triton_backend(
            _kernels().MoEKernelConfig(decode_max_tokens=decode_max, decode_max_pairs_per_expert=None)
        )
        prepared = prepared_copy(backend, w)
        for dtype in (torch.float32, torch.bfloat16):
            out = backend.forward(x, prepared, 2, LIMIT, out_dtype=dtype)
            assert out.dtype == dtype
            assert_close(out, ref, max(TOL, DECODE_TOL, 1e-2 if dtype == torch.bfloat16 else 0))
        assert backend.forward(x[:0], prepared, 2, LIMIT, out_dtype=torch.float32).dtype == torch.float32


class _NotLaunched:
    def __getitem__(self, grid):
        raise AssertionError("the decode GEMV ran")


@needs_triton
def test_triton_decode_guards_take_the_grouped_path(monkeypatch):
    """What the fp16 GEMVs cannot hold takes the grouped path, and still matches the reference:
    a SwiGLU limit with no bound, and scale bytes whose block sums could overflow float32."""
    mt = _kernels()
    w = make_weights(4, 64, 64, seed=14)
    x = torch.randn(1, 64, device=DEVICE).to(DTYPE)
    backend = triton_backend()
    prepared = prepared_copy(backend, w)
    monkeypatch.setattr(mt, "_gemv_gate_up_kernel", _NotLaunched())
    out = backend.forward(x, prepared, 2, float("inf"))
    assert_close(out, moe_reference(x.float(), float_copy(w), 2, float("inf")), TOL)
    prepared.max_scale = mt.GEMV_MAX_SCALE + 1  # as if some block had such a scale
    assert_close(backend.forward(x, prepared, 2, LIMIT), reference(x, w, 2), TOL)
    with pytest.raises(AssertionError, match="decode GEMV ran"):
        prepared.max_scale = mt.GEMV_MAX_SCALE
        backend.forward(x, prepared, 2, LIMIT)


# ----------------------------------------------------------------------------- Triton kernels

# (experts, hidden, intermediate, top_k): 96 = 3 scale blocks, so K pads to a whole 64-tile.
TINY = [(4, 64, 64, 2), (8, 96, 64, 4), (6, 64, 96, 3), (4, 160, 192, 2)]  # 1, 2 and 3 K tiles


@needs_triton
@pytest.mark.parametrize("shape", TINY)
def test_triton_router_matches_torch(shape):
    e_count, hidden, inter, top_k = shape
    mt = _kernels()
    w = make_weights(e_count, hidden, inter, seed=3)
    prepared = mt.prepare_moe_weights(w)
    x = torch.randn(19, hidden, device=DEVICE).to(DTYPE)
    ids = torch.empty(19, top_k, dtype=torch.int32, device=DEVICE)
    gates = torch.empty(19, top_k, dtype=torch.float32, device=DEVICE)
    out32 = torch.full((19, hidden), 5.0, device=DEVICE)
    import triton

    operand = triton.language.bfloat16 if CUDA else triton.language.float32
    k_per_split = 64  # two 32-value steps a split: 1 to 3 splits over these hidden sizes
    splits = -(-hidden // k_per_split)
    partial = torch.empty(splits, 19, e_count, device=DEVICE)
    counters = torch.full((2, e_count), 7, dtype=torch.int32, device=DEVICE)
    mt._router_partial_kernel[(2, splits)](
        x,
        prepared.router_weight,
        partial,
        out32,
        counters,
        19,
        hidden,
        e_count,
        x.stride(0),
        k_per_split,
        BLOCK_T=16,
        BLOCK_E=16,
        BLOCK_K=32,
        OPERAND=operand,
        PDL=0,
    )
    assert (counters == 0).all()
    counts = counters[0]
    mt._route_top_k_kernel[(5,)](
        partial,
        prepared.router_bias,
        ids,
        gates,
        counts,
        None,
        19,
        e_count,
        splits,
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        BLOCK_T=4,
        BLOCK_E=16,
        BLOCK_S=4,
        PDL=0,
    )
    want_ids, want_gates = route(x.float(), float_copy(w), top_k)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(gates, want_gates, rtol=1e-4, atol=1e-5)
    assert torch.equal(counts.cpu(), torch.bincount(want_ids.flatten().cpu(), minlength=e_count).int())
    assert (out32 == 0).all()


def _run_both_paths(w, x, top_k, tol=TOL, decode=True, **config):
    """Compare the decode (GEMV) and grouped paths (decode=False: the grouped one only) with the
    reference; returns their outputs."""
    mt = _kernels()
    ref = reference(x, w, top_k)
    outs = {}
    for name, decode_max in (("decode", x.shape[0]), ("grouped", 0))[0 if decode else 1 :]:
        backend = triton_backend(
            mt.MoEKernelConfig(decode_max_tokens=decode_max, decode_max_pairs_per_expert=None, **config)
        )
        out = backend.forward(x, prepared_copy(backend, w), top_k, LIMIT)
        assert out.dtype == x.dtype
        assert_close(out, ref, max(tol, DECODE_TOL) if name == "decode" else tol)
        outs[name] = out
    return outs


@needs_triton
@pytest.mark.slow  # (the decode GEMVs are slow under the interpreter; CI runs these)
@pytest.mark.parametrize("shape", TINY)
def test_triton_paths_match_reference(shape):
    e_count, hidden, inter, top_k = shape
    w = make_weights(e_count, hidden, inter, seed=4)
    for t in (1, 3):
        # The shapes are about K tiles; several tokens on the decode path once is enough (its
        # GEMVs are slow under the interpreter, and the padded-step test runs more).
        _run_both_paths(w, torch.randn(t, hidden, device=DEVICE).to(DTYPE), top_k, decode=t == 1 or shape == TINY[0])


def _routing_rows(e_count: int, seed: int) -> list[torch.Tensor]:
    """Router logit rows for the top-k tests: random ones, then ties (all equal: experts 0..3;
    many equal; a tie for first among ids out of order; two finite logits and the rest -inf),
    and last an all-NaN row (a NaN hidden state)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(e_count, generator=gen) for _ in range(3)]
    rows.append(torch.zeros(e_count))
    rows.append(torch.randint(0, 3, (e_count,), generator=gen).float())
    tied = torch.randn(e_count, generator=gen)
    tied[[e_count - 1, e_count - 3, 2]] = 9.0
    rows.append(tied)
    # fewer finite logits than top_k (an overflowed hidden state): the rest tie at -inf, and a
    # picked expert must not be picked again
    infinite = torch.full((e_count,), float("-inf"))
    infinite[[e_count - 2, 1]] = torch.tensor([0.5, 2.0])
    rows.append(infinite)
    rows.append(torch.full((e_count,), float("nan")))
    return rows


def _top_k_by_definition(rows, top_k: int) -> list[list[int]]:
    """Each row's top_k expert ids: largest logits first, ties to the lowest id."""
    return [sorted(range(len(r)), key=lambda e, r=r: (-r[e].item(), e))[:top_k] for r in rows]


def _top_k_probe_kernel():
    """A kernel writing the decode GEMVs' top-k pick (`_top_k_slot`) for each token and slot
    (built at each call, after the interpreter is set up; the kernel finds the function among
    this module's globals, as Triton resolves names)."""
    import triton
    import triton.language as tl

    globals().update(_top_k_slot=_kernels()._top_k_slot)

    @triton.jit
    def probe(logits, ids, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
        token = tl.program_id(0)
        for slot in tl.static_range(TOP_K):
            e, _ = _top_k_slot(logits, token, E, slot, TOP_K, BLOCK_E)  # noqa: F821
            tl.store(ids + token * TOP_K + slot, e)

    return probe


@needs_triton
@pytest.mark.parametrize("e_count, block_e", [(12, 16), (32, 32), (128, 128)])
def test_triton_top_k_slot_ties_and_nan(e_count, block_e):
    """The GEMVs' pick is the definition (largest logits, ties to the lowest id), ties included,
    and a NaN row (a NaN hidden state) still gives real experts' ids: an id past the last expert
    would make the GEMVs read past the weights (an illegal address ends the CUDA context)."""
    top_k = 4
    rows = _routing_rows(e_count, seed=5)
    logits = torch.stack(rows).to(DEVICE)
    ids = torch.full((len(rows), top_k), -1, dtype=torch.int32, device=DEVICE)
    _top_k_probe_kernel()[(len(rows),)](logits, ids, e_count, TOP_K=top_k, BLOCK_E=block_e)
    assert ids.cpu().tolist()[:-1] == _top_k_by_definition(logits[:-1].cpu(), top_k)
    assert ((ids[-1] >= 0) & (ids[-1] < e_count)).all()


@needs_triton
@pytest.mark.parametrize("e_count, block_e", [(12, 16), (16, 16)])
def test_triton_grouped_routing_ties_and_nan(e_count, block_e):
    """The grouped path's top-k: ties to the lowest id, as the GEMVs' pick, and on a NaN token row
    real experts' ids, counted as such (the align kernel indexes its cursors and the sorted rows
    by them). BLOCK_E == E is the real models' case (32, 128): there a NaN row's maximum is NaN
    itself and no logit equals it."""
    mt = _kernels()
    import triton

    top_k = 4
    rows = _routing_rows(e_count, seed=6)
    t_count = len(rows)
    partial = torch.stack(rows)[None].to(DEVICE)  # one split
    ids = torch.full((t_count, top_k), -1, dtype=torch.int32, device=DEVICE)
    gates = torch.empty(t_count, top_k, device=DEVICE)
    counts = torch.zeros(e_count, dtype=torch.int32, device=DEVICE)
    mt._route_top_k_kernel[(triton.cdiv(t_count, 4),)](
        partial,
        torch.zeros(e_count, device=DEVICE),
        ids,
        gates,
        counts,
        None,
        t_count,
        e_count,
        1,
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        BLOCK_T=4,
        BLOCK_E=block_e,
        BLOCK_S=1,
        PDL=0,
    )
    assert ids.cpu().tolist()[:-1] == _top_k_by_definition(rows[:-1], top_k)
    assert ((ids >= 0) & (ids < e_count)).all()
    assert torch.equal(counts.cpu(), torch.bincount(ids.flatten().long().cpu(), minlength=e_count).int())


@needs_triton
@pytest.mark.slow
def test_triton_decode_path_reads_only_what_it_wrote(monkeypatch):
    """The GEMVs walk whole tile pairs, so with an odd tile count (K = 64, 192) they read
    activations past H and I: the router and the gate_up programs past I must write zeros there.
    Every float buffer the module allocates starts as NaN here, so a value read but never
    written turns the output into NaN."""
    mt = _kernels()

    class NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            t = torch.empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(mt, "torch", NaNTorch())
    backend = triton_backend(mt.MoEKernelConfig(decode_max_pairs_per_expert=None))
    for e_count, hidden, inter in ((4, 64, 192), (4, 192, 64)):
        w = make_weights(e_count, hidden, inter, seed=8)
        x = torch.randn(1, hidden, device=DEVICE).to(DTYPE)  # (each pair's programs read alike: one token will do)
        assert_close(backend.forward(x, prepared_copy(backend, w), 2, LIMIT), reference(x, w, 2), max(TOL, DECODE_TOL))


@needs_triton
@pytest.mark.slow
def test_triton_decode_steps_of_two_tile_pairs():
    """gemv_block_u=4: a GEMV step spans two tile pairs; with an odd number of pairs (1 for
    K = 64, 3 for K = 320) the second pair of the last step lies past the row's chunks and is
    masked out."""
    mt = _kernels()
    w = make_weights(4, 64, 320, seed=6)
    x = torch.randn(1, 64, device=DEVICE).to(DTYPE)
    backend = triton_backend(mt.MoEKernelConfig(gemv_block_u=4, decode_max_pairs_per_expert=None))
    assert_close(backend.forward(x, prepared_copy(backend, w), 2, LIMIT), reference(x, w, 2), max(TOL, DECODE_TOL))
    for bad in (1, 3, 0):
        with pytest.raises(ValueError, match="gemv_block_u"):
            mt.MoEKernelConfig(gemv_block_u=bad)


@needs_triton
@pytest.mark.slow
def test_triton_add_norm_moe_matches_add_rms_norm_then_moe():
    """The residual add and RMSNorm folded into the MoE (the decode router kernel does them;
    the grouped path runs the norm kernel first) give the same residual and output as
    `add_rms_norm_reference` followed by the plain MoE."""
    from inference.ops.rmsnorm import add_rms_norm_reference

    w = make_weights(4, 96, 64, seed=8)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 96, generator=g) * 3).to(DEVICE, DTYPE)  # (few rows: the decode GEMVs are slow interpreted)
    delta = torch.randn(2, 96, generator=g).to(DEVICE, DTYPE)
    norm_weight = (torch.rand(96, generator=g) + 0.5).to(DEVICE, DTYPE)
    want_residual, h = add_rms_norm_reference(x, delta, norm_weight, 1e-5)
    for decode_max in (2, 0):  # the decode path, then the grouped one
        backend = triton_backend(
            _kernels().MoEKernelConfig(decode_max_tokens=decode_max, decode_max_pairs_per_expert=None)
        )
        prepared = prepared_copy(backend, w)
        residual, out = backend.add_norm_forward(x, delta, norm_weight, 1e-5, prepared, 2, LIMIT)
        assert torch.equal(residual, want_residual)
        assert_close(out, backend.forward(h, prepared, 2, LIMIT), 1e-2 if CUDA else 1e-5)
        assert_close(out, reference(h, w, 2), max(TOL, DECODE_TOL))


@needs_triton
@pytest.mark.parametrize("path", [pytest.param("decode", marks=pytest.mark.slow), "grouped"])
def test_triton_valid_tokens_route_padding_nowhere(path):
    """A CUDA graph's padded step (valid_tokens = n of T rows): the n real rows get what the
    unpadded batch gets, and the padding rows route to no expert at all, so their output rows
    stay zero (any routed pair would add its expert's nonzero bias there). The grouped path
    also sees pads across blocks (n = 5 of 12 in 16-token blocks), the add + norm variant too;
    the decode path n = 1 of 2 (fewer rows: its GEMV programs, one set per (token, slot), are
    slow under the interpreter)."""
    mt = _kernels()
    w = make_weights(4, 96, 64, seed=12)
    g = torch.Generator().manual_seed(13)
    rows = 2 if path == "decode" else 12
    x = torch.randn(rows, 96, generator=g).to(DEVICE, DTYPE)
    delta = torch.randn(rows, 96, generator=g).to(DEVICE, DTYPE)
    norm_weight = (torch.rand(96, generator=g) + 0.5).to(DEVICE, DTYPE)
    from inference.ops.rmsnorm import add_rms_norm_reference

    want_residual, h = add_rms_norm_reference(x, delta, norm_weight, 1e-5)
    decode_max = rows if path == "decode" else 0
    backend = triton_backend(
        mt.MoEKernelConfig(decode_max_tokens=decode_max, decode_max_pairs_per_expert=None, block_m=16)
    )
    prepared = prepared_copy(backend, w)
    tol = max(TOL, DECODE_TOL) if path == "decode" else TOL
    for n in (1,) if path == "decode" else (1, 5, 12):
        valid = torch.tensor([n], dtype=torch.int32, device=DEVICE)
        out = backend.forward(x, prepared, 2, LIMIT, valid_tokens=valid)
        assert_close(out[:n], reference(x[:n], w, 2), tol)
        assert torch.count_nonzero(out[n:]) == 0
        residual, fused = backend.add_norm_forward(x, delta, norm_weight, 1e-5, prepared, 2, LIMIT, valid_tokens=valid)
        assert torch.equal(residual, want_residual)  # the add covers every row
        assert_close(fused[:n], backend.forward(h[:n], prepared, 2, LIMIT), tol)
        assert torch.count_nonzero(fused[n:]) == 0
    with pytest.raises(ValueError, match="valid_tokens"):
        backend.forward(x, prepared, 2, LIMIT, valid_tokens=torch.tensor([3], device=DEVICE))


@needs_triton
@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_triton_expert_shares_sum_to_the_block(path):
    """Expert parallelism in the kernels: a rank holding experts [first, first + count) of the
    router's routes every token over all of them and adds only its own experts' pairs; the
    ranks' shares sum to the whole block, with the fused add + norm too, and padding rows
    (valid_tokens) stay zero. (The decode GEMVs are slow under the interpreter: 2 tokens, 2 ranks.)"""
    mt = _kernels()
    w = make_weights(8, 64, 64, seed=21)
    tokens, rank_counts = (2, (2,)) if path == "decode" else (6, (2, 4))
    g = torch.Generator().manual_seed(22)
    x = torch.randn(tokens, 64, generator=g).to(DEVICE, DTYPE)
    backend = triton_backend(
        mt.MoEKernelConfig(decode_max_tokens=tokens if path == "decode" else 0, decode_max_pairs_per_expert=None)
    )
    whole = backend.forward(x, prepared_copy(backend, w), 2, LIMIT, out_dtype=torch.float32)
    assert_close(whole, reference(x, w, 2), max(TOL, DECODE_TOL) if path == "decode" else TOL)
    rel = 1e-2 if CUDA else 1e-5
    for ranks in rank_counts:
        per = 8 // ranks
        prepared = [prepared_copy(backend, expert_share(w, r * per, per)) for r in range(ranks)]
        assert prepared[1].num_experts == per and prepared[1].router_experts == 8 and prepared[1].expert_offset == per
        shares = [backend.forward(x, p, 2, LIMIT, out_dtype=torch.float32) for p in prepared]
        assert all(share.abs().sum() > 0 for share in shares)
        assert_close(sum(shares), whole, rel)
    delta = torch.randn(tokens, 64, generator=g).to(DEVICE, DTYPE)
    norm = torch.ones(64, device=DEVICE, dtype=DTYPE)
    _, fused_whole = backend.add_norm_forward(
        x, delta, norm, 1e-5, prepared_copy(backend, w), 2, LIMIT, out_dtype=torch.float32
    )
    fused = [
        backend.add_norm_forward(
            x, delta, norm, 1e-5, prepared_copy(backend, expert_share(w, r * 4, 4)), 2, LIMIT, out_dtype=torch.float32
        )[1]
        for r in range(2)
    ]
    assert_close(sum(fused), fused_whole, rel)
    if path == "grouped":
        valid = torch.tensor([4], dtype=torch.int32, device=DEVICE)
        padded = [
            backend.forward(
                x,
                prepared_copy(backend, expert_share(w, r * 4, 4)),
                2,
                LIMIT,
                out_dtype=torch.float32,
                valid_tokens=valid,
            )
            for r in range(2)
        ]
        assert_close(sum(padded)[:4], whole[:4], rel)
        assert all(torch.count_nonzero(share[4:]) == 0 for share in padded)


@needs_triton
def test_triton_grouped_many_tokens_and_block_sizes():
    """More pairs than one block per expert, each block size the heuristic can pick."""
    mt = _kernels()
    w = make_weights(4, 64, 64, seed=5)
    x = torch.randn(45, 64, device=DEVICE).to(DTYPE)
    ref = reference(x, w, 2)
    for block_m, down_n in ((16, 128), (32, 16), (64, 64), (128, 64), (128, 128)):
        config = mt.MoEKernelConfig(
            decode_max_tokens=0,
            block_m=block_m,
            block_n=32,
            down_block_n=down_n,
            router_block_k=32 if block_m == 32 else 64,
        )  # 32: the router in two splits
        backend = triton_backend(config)
        assert_close(backend.forward(x, prepared_copy(backend, w), 2, LIMIT), ref, TOL)


@needs_triton
def test_triton_narrow_blocks_match_wide_ones():
    """A block whose pairs fill at most half of it runs half as wide (`_block_rows`): skewed
    routing gives full blocks, an expert's half-empty last block and a lone small block in one
    batch, and the output is the reference's with narrow blocks on and off, at two block sizes."""
    mt = _kernels()
    w = make_weights(4, 64, 64, seed=12)
    w.router_bias = torch.tensor([2.0, 0.5, 0, -1.0], dtype=DTYPE, device=DEVICE)
    x = torch.randn(67, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE, DTYPE)
    ref = reference(x, w, 2)
    counts = torch.bincount(route(x.float(), float_copy(w), 2)[0].flatten(), minlength=4).tolist()  # [65, 44, 17, 8]
    for block_m in (32, 64):
        tails = [c % block_m for c in counts if c]
        assert any(c > block_m for c in counts) and any(0 < t <= block_m // 2 for t in tails), (counts, block_m)
        assert any(t == 0 or t > block_m // 2 for t in tails), (counts, block_m)  # and a wide last block
        for narrow in (True, False):
            config = mt.MoEKernelConfig(decode_max_tokens=0, block_m=block_m, block_n=32, narrow_blocks=narrow)
            backend = triton_backend(config)
            assert_close(backend.forward(x, prepared_copy(backend, w), 2, LIMIT), ref, TOL)


@needs_triton
def test_triton_decode_path_by_batch_and_experts():
    """The GEMVs take a batch up to decode_max_tokens tokens with no more (token, slot) pairs
    than experts: 20b (32 experts, top-4) up to 8 tokens, 120b (128) up to 16."""
    mt = _kernels()
    assert mt.takes_decode_path(8, 4, 32) and not mt.takes_decode_path(9, 4, 32)
    assert mt.takes_decode_path(16, 4, 128) and not mt.takes_decode_path(17, 4, 128)
    unlimited = mt.MoEKernelConfig(decode_max_pairs_per_expert=None)
    assert mt.takes_decode_path(16, 4, 32, unlimited) and not mt.takes_decode_path(17, 4, 32, unlimited)


@needs_triton
def test_triton_grouped_block_size_leaves_room_for_the_spread():
    """Blocks hold 1.5x the mean pairs an expert (16..64 tokens), so a typical expert's pairs
    fit one block; 128-token blocks past 64 pairs an expert; a configured size wins."""
    mt = _kernels()
    pick = lambda pairs, experts: mt._block_m(pairs, experts, mt.DEFAULT_CONFIG)  # noqa: E731
    assert pick(4 * 64, 32) == 16  # 8 an expert (20b, batch 64)
    assert pick(4 * 128, 32) == 32  # 16 an expert (batch 128)
    assert pick(4 * 256, 32) == 64  # 32 an expert
    assert pick(4 * 512, 32) == 64  # 64 an expert (20b, 512 sequences decoding)
    assert pick(4 * 640, 32) == 128 and pick(4 * 1280, 32) == 128  # 80, 160 (a mixed step)
    assert pick(4 * 1280, 128) == 64  # 40 an expert (120b, a mixed step)
    assert pick(4 * 64, 128) == 16 and pick(4 * 8192, 32) == 128  # the bounds
    for pairs, experts in ((256, 32), (700, 32), (2048, 128), (5000, 128)):
        assert pick(pairs, experts) >= min(64, 1.5 * pairs / experts)
    assert mt._block_m(4 * 128, 32, mt.MoEKernelConfig(block_m=64)) == 64


@needs_triton
@pytest.mark.slow
def test_triton_skewed_routing():
    """Every token picks the same experts: those get all tokens, the rest none."""
    w = make_weights(8, 64, 64, seed=6)
    w.router_bias = torch.tensor([0, 0, 50, 0, 0, 40, 0, 0], dtype=DTYPE, device=DEVICE)
    x = torch.randn(21, 64, device=DEVICE).to(DTYPE)
    ids, _ = route(x.float(), float_copy(w), 2)
    assert set(ids.flatten().tolist()) == {2, 5}
    _run_both_paths(w, x[:3], 2)
    mt = _kernels()
    backend = triton_backend(mt.MoEKernelConfig(decode_max_tokens=0))
    assert_close(backend.forward(x, prepared_copy(backend, w), 2, LIMIT), reference(x, w, 2), TOL)


@needs_triton
@pytest.mark.slow
def test_triton_large_scales():
    """Scale bytes above 128 (weights beyond 2^1 * 6) take the two-multiply dequantisation."""
    mt = _kernels()
    w = make_weights(4, 64, 64, seed=7, weight_scale=300.0)
    assert w.experts.gate_up_scales.max() > 128
    assert mt.prepare_moe_weights(w).large_scales
    x = (torch.randn(3, 64, device=DEVICE) * 1e-3).to(DTYPE)
    _run_both_paths(w, x, 2)


@needs_triton
def test_triton_empty_batch_and_bad_shape():
    mt = _kernels()
    w = make_weights(4, 64, 64, seed=8)
    prepared = mt.prepare_moe_weights(w)
    assert mt.fused_moe(torch.empty(0, 64, device=DEVICE, dtype=DTYPE), prepared, 2, LIMIT).shape == (0, 64)
    with pytest.raises(ValueError):
        mt.fused_moe(torch.zeros(1, 32, device=DEVICE, dtype=DTYPE), prepared, 2, LIMIT)


@needs_triton
def test_triton_prepare_releases_packed_weights():
    backend = triton_backend()
    w = make_weights(4, 64, 64, seed=9)
    x = torch.randn(1, 64, device=DEVICE).to(DTYPE)
    ref = reference(x, w, 2)
    prepared = backend.prepare(w)
    assert w.experts.gate_up_blocks is None and w.experts.down_blocks is None
    assert_close(backend.forward(x, prepared, 2, LIMIT), ref, DECODE_TOL)  # T=1: the decode path


# ----------------------------------------------------------------------------- GPU only: real shapes


@gpu_only
@pytest.mark.parametrize("e_count", [32, 128])
def test_gpu_real_shapes(e_count):
    """gpt-oss shapes (H = I = 2880, 90 scale blocks) with random weights, both paths, and
    batches where many experts get no tokens (T=1) and where every expert gets many."""
    w = random_packed_weights(e_count, 2880, 2880, seed=10)
    for t in (1, 4):
        x = torch.randn(t, 2880, device=DEVICE).to(DTYPE)
        _run_both_paths(w, x, 4)
    mt = _kernels()
    backend = triton_backend(mt.MoEKernelConfig(decode_max_tokens=0))
    prepared = prepared_copy(backend, w)
    for t in (37, 700):
        x = torch.randn(t, 2880, device=DEVICE).to(DTYPE)
        assert_close(backend.forward(x, prepared, 4, LIMIT), reference(x, w, 4), TOL)


@gpu_only
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_cuda_graph_capture(t):
    """forward has no host synchronisation: it captures in a graph and replays on new inputs."""
    w = random_packed_weights(32, 256, 128, seed=11)
    backend = select_moe_backend("cuda")
    prepared = prepared_copy(backend, w)
    x = torch.randn(t, 256, device=DEVICE).to(DTYPE)
    backend.forward(x, prepared, 4, LIMIT)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = backend.forward(x, prepared, 4, LIMIT)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(2):
        x.copy_(torch.randn(t, 256, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE))
        graph.replay()
        assert_close(out, reference(x, w, 4), TOL)
