"""Triton kernels for the gpt-oss MoE block with MXFP4 experts and bf16 activations.

The math is `inference.ops.moe.reference.moe_reference`; expert weights stay 4-bit on the GPU and are
dequantised in registers. `prepare_moe_weights` converts the checkpoint's packed layout once at
load time into the layout below; `fused_moe` runs one MoE block. Two paths:

  decode, small T (`takes_decode_path`; GEMVs on CUDA cores, 3 launches; latency-bound at batch 1):
    router logits, spread over many programs; also zeroes the fp32 output rows and
        writes x as scaled fp16 for the GEMVs                                        [T, E]
    gate_up GEMV per (token, slot): top-k + softmax of the token's logits in its
        prologue, the clamped SwiGLU in its epilogue                         act [T*k, I_pad] fp16
    down GEMV per (token, slot): epilogue scales by the routing weight and
        atomically adds into the token's fp32 output row                             [T, H]
    (a cast to the output dtype, unless the caller takes the float32 sums)
  larger batches (grouped GEMMs on tensor cores, 5 launches plus the cast):
    router partial logits over splits of H; also zeroes the output rows and
        the expert counters                                                   partial [S, T, E]
    route top-k: logits, top-k, softmax, per-expert counts                           ids, gates
    align: (token, slot) pairs grouped by expert into BLOCK_M-row blocks
    gate_up grouped GEMM + SwiGLU epilogue, rows in expert order                     act [R, I]
    down grouped GEMM, routing-weighted atomic adds into the fp32 output rows        [T, H]
    (BLOCK_M leaves room for the spread of pairs an expert, `_block_m`; a block at most half
    full runs both GEMMs half as wide, `_block_rows`)

Nothing here reads a GPU value on the host, so both paths can be captured in a CUDA graph.
The fp32 atomics make the order of a token's k expert sums vary between runs (float rounding).

Weight layout (per expert, a matrix W [N, K] used as y = x W^T):
    K is cut into 64-value tiles, and the tiles into pairs (zero blocks pad the last pair).
    Byte j (0..31) of tile t holds value 64t+j in its low half and value 64t+32+j in its high
    half ("planar"): a tile's low halves are one whole 32-value scale block and its high halves
    the next, so the two dequantise without shuffling values across registers. Bits of a byte:
    low value's sign 0 and magnitude 1-3, high value's sign 4 and magnitude 5-7 (see
    `_e2m1_tiny`; the decode GEMVs read the same bytes as 32-bit words, see `WORD_PAIR_DOT_PTX`).
    w  uint8 [E, G, P, R, 64]: rows in groups of 8 (ROW_GROUP); for group g and tile pair p,
       the R rows' 64 bytes (tile 2p, then 2p+1) lie together. A decode GEMV program reads one
       group, so each loop step reads one contiguous chunk.
    s  int32 [E, G, P, R]: each row's four scale bytes of pair p in one word (tile 2p's low and
       high block in bits 0-15, tile 2p+1's in 16-31), next to the chunk's order: one aligned
       load a step for the GEMVs, and a word the grouped GEMMs' pipeliner copies ahead.
    Down projection: R = 8 rows of W2. gate_up: the checkpoint's interleaved rows are split
    into gates and ups, and R = 16: group g's 8 gate rows (columns 8g..8g+7 of the SwiGLU
    output), then its 8 up rows, so the GEMV's gate and up rows are one chunk and the SwiGLU
    epilogue pairs gate row n with up row n.
Against whole rows with a separate scale array, this layout took the 20b MoE layer from 31 to
28 us at batch 1 and from 231 to 206 us at 64 tokens (H200, docs/benchmark-log.md "Row groups").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference.ops.dependent_launch import pdl_options, wait_for_previous
from inference.ops.moe import persistent
from inference.ops.moe.reference import MoEWeights
from inference.ops.mxfp4 import BLOCK_SIZE
from inference.ops.rmsnorm import add_rms_norm_triton, residual_add, rms_rstd, rms_scaled

SWIGLU_ALPHA = 1.702
ROW_GROUP = 8  # weight rows stored together (a decode GEMV program's rows)
_GROUP = tl.constexpr(ROW_GROUP)


# ----------------------------------------------------------------------------- layout


@dataclass
class TritonMoEWeights:
    """One layer's MoE weights in the kernels' layout (see the module docstring)."""

    router_weight: torch.Tensor  # [E, H] as loaded (bf16 on GPU)
    router_bias: torch.Tensor  # [E] float32
    w1: torch.Tensor  # [E, I/8, P1, 16, 64] uint8: per group 8 gate rows, then 8 up rows
    s1: torch.Tensor  # [E, I/8, P1, 16] int32
    b1: torch.Tensor  # [E, 2I] float32, gates then ups
    w2: torch.Tensor  # [E, H/8, P2, 8, 64] uint8
    s2: torch.Tensor  # [E, H/8, P2, 8] int32
    b2: torch.Tensor  # [E, H] float32
    max_scale: int  # the largest scale byte; the decode GEMVs take up to GEMV_MAX_SCALE
    # Expert parallelism: w1..b2 hold experts [expert_offset, expert_offset + num_experts) of the
    # router's; pairs routed to the others are skipped (another rank adds them).
    expert_offset: int = 0

    @property
    def large_scales(self) -> bool:
        """Some scale byte > 128: the grouped path dequantises in two multiplies (see _dequant)."""
        return self.max_scale > 128

    @property
    def num_experts(self) -> int:
        """The experts held here (all of the router's, except under expert parallelism)."""
        return self.w1.shape[0]

    @property
    def router_experts(self) -> int:
        return self.router_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.router_weight.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w1.shape[1] * ROW_GROUP


def planar_tiles(blocks: torch.Tensor, padded_blocks: int) -> torch.Tensor:
    """HF MXFP4 blocks [..., B, 16] -> the planar bytes [..., padded_blocks / 2, 32] of their
    64-value tiles (module docstring), zero blocks after the B given."""
    *lead, b, _ = blocks.shape
    codes = torch.zeros(*lead, padded_blocks, BLOCK_SIZE, dtype=torch.uint8, device=blocks.device)
    codes[..., :b, :] = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*lead, b, BLOCK_SIZE)
    codes = codes.view(*lead, padded_blocks // 2, 2, BLOCK_SIZE)
    low, high = codes[..., 0, :], codes[..., 1, :]  # e2m1 codes in value order: sign bit 3, magnitude 0-2
    return (low >> 3) | ((low & 7) << 1) | ((high & 8) << 1) | ((high & 7) << 5)


def pack_row_groups(
    blocks: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None = None, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF MXFP4 (blocks [E, N, B, 16], scales [E, N, B]) -> (w [E, G, P, R, 64] uint8,
    s [E, G, P, R] int32) in the layout of the module docstring.

    `rows` optionally reorders the N rows first. The N rows are `parts` matrices of equal height
    (gate_up: the gates, then the ups) whose groups of 8 rows sit side by side: R = 8 * parts,
    G = N / R. P = B / 4 rounded up; zero blocks with scale 0 pad the last pair. Works expert by
    expert to bound the temporary memory.
    """
    e_count, n, b, _ = blocks.shape
    if n % (ROW_GROUP * parts):
        raise ValueError(f"{n} rows do not split into {parts} parts of whole {ROW_GROUP}-row groups")
    groups, width, pairs = n // (ROW_GROUP * parts), ROW_GROUP * parts, -(-b // 4)
    w = torch.empty(e_count, groups, pairs, width, 64, dtype=torch.uint8, device=blocks.device)
    s = torch.empty(e_count, groups, pairs, width, dtype=torch.int32, device=blocks.device)

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [N, P, ...] -> [G, P, R, ...]
        rest = t.shape[2:]
        t = t.reshape(parts, groups, ROW_GROUP, pairs, *rest).permute(1, 3, 0, 2, *range(4, 4 + len(rest)))
        return t.reshape(groups, pairs, width, *rest)

    for e in range(e_count):
        bl, sc = (blocks[e], scales[e]) if rows is None else (blocks[e, rows], scales[e, rows])
        w[e] = grouped(planar_tiles(bl, 4 * pairs).reshape(n, pairs, 64))
        scale_bytes = torch.zeros(n, 4 * pairs, dtype=torch.uint8, device=blocks.device)
        scale_bytes[:, :b] = sc
        s[e] = grouped(scale_bytes.view(torch.int32))  # little-endian: tile 2p's bytes in bits 0-15
    return w, s


def prepare_moe_weights(weights: MoEWeights) -> TritonMoEWeights:
    """Convert one layer's MXFP4 MoE weights to the kernels' layout (once, at load time)."""
    ex = weights.experts
    if not ex.is_mxfp4:
        raise ValueError("the Triton MoE kernels need MXFP4 experts")
    hidden = weights.router_weight.shape[1]
    e_count, two_i = ex.gate_up_bias.shape  # the experts held (expert parallelism: a share)
    inter = two_i // 2
    expect = {
        "gate_up_blocks": (ex.gate_up_blocks, (e_count, two_i, hidden // BLOCK_SIZE, 16)),
        "down_blocks": (ex.down_blocks, (e_count, hidden, inter // BLOCK_SIZE, 16)),
    }
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape or hidden % BLOCK_SIZE or inter % BLOCK_SIZE:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    dev = ex.gate_up_blocks.device
    deinterleave = torch.cat([torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)]).to(dev)
    w1, s1 = pack_row_groups(ex.gate_up_blocks, ex.gate_up_scales, deinterleave, parts=2)
    w2, s2 = pack_row_groups(ex.down_blocks, ex.down_scales)
    return TritonMoEWeights(
        router_weight=weights.router_weight.contiguous(),
        router_bias=weights.router_bias.float().contiguous(),
        w1=w1,
        s1=s1,
        b1=ex.gate_up_bias.float()[:, deinterleave.to(ex.gate_up_bias.device)].contiguous(),
        w2=w2,
        s2=s2,
        b2=ex.down_bias.float().contiguous(),
        max_scale=int(torch.maximum(ex.gate_up_scales.max(), ex.down_scales.max())),
        expert_offset=weights.expert_offset,
    )


# ----------------------------------------------------------------------------- device helpers

# fp32 bit masks, written as int32 values so the bit tricks stay 32-bit.
_E2M1_FP32_MASK = tl.constexpr(0x81C00000 - (1 << 32))  # sign bit 31, magnitude bits 22-24
_SHIFT_17_27 = tl.constexpr((1 << 17) + (1 << 27))  # x * this == (x << 17) | (x << 27) for a byte
_SHIFT_21_31 = tl.constexpr((1 << 21) + (1 << 31) - (1 << 32))  # == (x << 21) | (x << 31), as int32
_TWO_POW_112 = tl.constexpr(5.192296858534828e33)
_TWO_POW_126 = tl.constexpr(8.507059173023462e37)
FP16_ACTIVATION_MAX = 32768.0  # |x| the GEMVs scale their fp16 activations to (fp16 max 65504)
GEMV_MAX_LIMIT = 64.0  # larger SwiGLU limits would scale small activations into fp16 subnormals
GEMV_MAX_SCALE = 224  # larger scale bytes could overflow the GEMVs' float32 block sums


@triton.jit
def _e2m1_tiny(byte, HIGH: tl.constexpr):
    """One half of each packed byte (int32 0..255) -> float32 e2m1 * 2^-126, exactly.

    The code's 3 magnitude bits land on fp32 bits 22-24 and its sign on bit 31, which is that
    value (a subnormal when the exponent bits are 0; fp32 math here keeps subnormals). The
    byte layout (low value: sign bit 0, magnitude bits 1-3; high value: sign bit 4, magnitude
    bits 5-7) makes the two shifted copies of the byte 10 bits apart, so they never overlap:
    their OR is a sum, one integer multiply does both shifts, and one AND finishes.
    """
    if HIGH:
        bits = (byte * _SHIFT_17_27) & _E2M1_FP32_MASK
    else:
        bits = (byte * _SHIFT_21_31) & _E2M1_FP32_MASK
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant(byte, scale, HIGH: tl.constexpr, LARGE_SCALES: tl.constexpr):
    """MXFP4 bytes (int32) and their block scales (int32, broadcastable) -> float32 weights.

    e2m1 * 2^-126 times 2^(scale - 1) is e2m1 * 2^(scale - 127); that factor is a normal float
    only for scale <= 128, so checkpoints with larger scales take two multiplies.
    """
    tiny = _e2m1_tiny(byte, HIGH)
    if LARGE_SCALES:
        return tiny * _TWO_POW_126 * (scale << 23).to(tl.float32, bitcast=True)
    return tiny * ((scale + 126) << 23).to(tl.float32, bitcast=True)


# The grouped GEMMs' dequantisation, as packed bf16 pairs. The tensor-core operand layout holds
# K-adjacent elements in pairs, so the assembly takes two bytes (two elements) at a time:
#   move the bytes to bits 0-7 and 16-23 (prmt), then per half-byte one mask, one multiply (two
#           shifted copies that never overlap, as in the GEMVs) and one mask put each value's
#           sign at bit 15 and its magnitude code at bits 6-8 of its half: e2m1 * 2^-126 as
#           bf16 (a subnormal for 0.5);
#   multiply each pair by its block's 2^(scale - 1) (exact: e2m1 has 2 significant bits).
# About 2.3 instructions a weight, where the float32 path (`_dequant`, then a cast) takes 4.
# Operands: $2 the two bytes; $3 / $4 the multipliers of the low / high values (bf16 pairs);
# results $0 / $1 the low / high values (bf16 pairs). Scale bytes above 128 (no such
# multiplier in bf16) take `_dequant`.
GROUPED_DEQUANT_PTX = """
{
.reg .b32 w, t, m;
cvt.u32.u16 w, $2;
prmt.b32 t, w, 0, 0x3130;
and.b32 m, t, 0x000F000F;
mul.lo.u32 m, m, 0x8020;
and.b32 m, m, 0x81C081C0;
mul.rn.bf16x2 $0, m, $3;
and.b32 m, t, 0x00F000F0;
mul.lo.u32 m, m, 0x0802;
and.b32 m, m, 0x81C081C0;
mul.rn.bf16x2 $1, m, $4;
}
"""
_GROUPED_DEQUANT = tl.constexpr(GROUPED_DEQUANT_PTX)


@triton.jit
def _bf16_power_of_two(scale):
    """2^(scale - 1) as bf16, for scale bytes (int32) 0..128."""
    return ((scale + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_tile(w, scales, PACKED: tl.constexpr, LARGE_SCALES: tl.constexpr, OPERAND: tl.constexpr):
    """One 64-value K tile of BN weight rows: bytes w [BN, 32] uint8, scales [BN] int32 with the
    tile's two scale bytes in bits 0-7 (low values) and 8-15 (high values) -> (low values,
    high values), each [BN, 32] in OPERAND. PACKED: `GROUPED_DEQUANT_PTX` (bf16, scale bytes
    up to 128); otherwise `_dequant` in float32."""
    s_lo = (scales & 0xFF)[:, None]
    s_hi = ((scales >> 8) & 0xFF)[:, None]
    if PACKED:
        f_lo = tl.broadcast_to(_bf16_power_of_two(s_lo), w.shape)
        f_hi = tl.broadcast_to(_bf16_power_of_two(s_hi), w.shape)
        lo, hi = tl.inline_asm_elementwise(
            _GROUPED_DEQUANT,
            "=r,=r,h,r,r",
            [w, f_lo, f_hi],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=2,
        )
        return lo, hi
    b = w.to(tl.int32)
    return _dequant(b, s_lo, False, LARGE_SCALES).to(OPERAND), _dequant(b, s_hi, True, LARGE_SCALES).to(OPERAND)


_WORD_DECODE_PTX = """
and.b32 m, {w}, 0x000F000F;
mul.lo.u32 m, m, 0x8100;
and.b32 h0, m, 0x8E008E00;
and.b32 m, {w}, 0x0F000F00;
mul.lo.u32 m, m, 0x81;
and.b32 h1, m, 0x8E008E00;
and.b32 m, {w}, 0x00F000F0;
mul.lo.u32 m, m, 0x810;
and.b32 h2, m, 0x8E008E00;
and.b32 m, {w}, 0xF000F000;
shr.b32 t, m, 4;
shl.b32 m, m, 3;
or.b32 t, t, m;
and.b32 h3, t, 0x8E008E00;
"""  # one word $w -> h0..h3 (see below)

# The decode GEMVs' inner step, for 2 or 4 32-bit words of one 64-value tile (8 weights each):
#   decode  each word's 8 values as 4 fp16x2 pairs of e2m1 * 2^-14 (fp16 subnormals for 0.5),
#           moving each code's sign to bit 15 and magnitude to bits 9-11 of its half:
#           h0 = ((w & 0x000F000F) * 0x8100) & M   low values of bytes 0, 2 (shifts 8 and 15)
#           h1 = ((w & 0x0F000F00) * 0x81) & M     low values of bytes 1, 3 (shifts 0 and 7)
#           h2 = ((w & 0x00F000F0) * 0x810) & M    high values of bytes 0, 2 (shifts 4 and 11)
#           h3 = ((m >> 4) | (m << 3)) & M with m = w & 0xF000F000, high values of bytes 1, 3
#           where M = 0x8E008E00; each multiply's two shifted copies never overlap, so it ORs;
#   multiply with the matching fp16x2 activation pairs (packed HFMA2, two weights an
#           instruction), low and high values apart since they are different scale blocks;
#   widen   each accumulator's two halves to fp32 and add them.
# Products with bf16 x are exact in fp16 (2 + 8 significant bits); the SwiGLU output, stored
# with 11, rounds once more in its products. Each fp16 sum has 2 terms a word (at most 12 each,
# so 4 words stay far from fp16's range): 4.8e-4 relative to the float32 reference on gpt-oss
# shapes with 2 words, below a bf16 output's rounding (docs/benchmark-log.md).
# Operands: $2.. the words; then per word 4 registers: the x pairs of its low values from
# bytes (0, 2) and (1, 3), then those of its high values. `_word_pair_dot_emulated` is the
# same function in Triton ops, a pair of words at a time. The GEMVs run 4 words a call: half
# the widenings of 2, a loop step of 432 SASS instructions instead of 464 (gate_up, sm_90) and a
# batch-1 layer 3.6% faster on an H200 (the relative error to float32 goes from 4.8e-4 to about
# 7e-4, still below a bf16 output's rounding).


def word_dot_ptx(words: int) -> str:
    """The inline assembly for `words` (2 or 4) words: results $0 (low values' sum), $1 (high)."""
    x = 2 + words  # first x register
    body = []
    for k in range(words):
        r = x + 4 * k
        first = "mul.rn.f16x2 {acc}, {h}, ${r};" if k == 0 else "fma.rn.f16x2 {acc}, {h}, ${r}, {acc};"
        body.append(_WORD_DECODE_PTX.format(w=f"${2 + k}").strip())
        body.append(first.format(acc="a", h="h0", r=r))
        body.append(f"fma.rn.f16x2 a, h1, ${r + 1}, a;")
        body.append(first.format(acc="b", h="h2", r=r + 2))
        body.append(f"fma.rn.f16x2 b, h3, ${r + 3}, b;")
    widen = """mov.b32 {lo, hi}, a;
cvt.f32.f16 fl, lo;
cvt.f32.f16 fh, hi;
add.f32 $0, fl, fh;
mov.b32 {lo, hi}, b;
cvt.f32.f16 fl, lo;
cvt.f32.f16 fh, hi;
add.f32 $1, fl, fh;"""
    return (
        "{\n.reg .b32 t, m, h0, h1, h2, h3, a, b;\n.reg .f16 lo, hi;\n.reg .f32 fl, fh;\n"
        + "\n".join(body)
        + "\n"
        + widen
        + "\n}\n"
    )


WORD_PAIR_DOT_PTX = word_dot_ptx(2)
WORD_QUAD_DOT_PTX = word_dot_ptx(4)  # the GEMVs' step: one widening per 4 words instead of 2
_WORD_QUAD_DOT = tl.constexpr(WORD_QUAD_DOT_PTX)


@triton.jit
def _permuted(k):
    """Where natural index k sits in a GEMV activation row: in each group of 4, the middle two
    swap, so that 32-bit word 2g holds (k=4g, 4g+2) and word 2g+1 (4g+1, 4g+3), the pairs the
    decode makes from bytes (0, 2) and (1, 3)."""
    return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1)


@triton.jit
def _four_words(ptrs, tile_ok):
    """ptrs [U, 4, 4] over 4 consecutive int32 words each -> the 4 words as 4 [U, 4] tensors,
    from one 16-byte load per (u, i), split in registers."""
    x4 = tl.load(ptrs, mask=tile_ok[:, None, None], other=0)
    even, odd = tl.split(tl.reshape(x4, (x4.shape[0], x4.shape[1], 2, 2)))  # words (0, 2), (1, 3)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _fp16_halves(pair):
    """int32 holding an fp16x2 pair -> its (low, high) halves as float32."""
    lo = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((pair >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_dot_emulated(w, x02, x13, HIGH: tl.constexpr):
    """One word's low (or HIGH) values of bytes 0-3 against the fp16x2 pairs x02 (bytes 0, 2)
    and x13 (bytes 1, 3), in float32: the exact sum the assembly rounds to fp16 in 2 steps."""
    x0, x2 = _fp16_halves(x02)
    x1, x3 = _fp16_halves(x13)
    total = _e2m1_tiny(w & 0xFF, HIGH) * x0 + _e2m1_tiny((w >> 8) & 0xFF, HIGH) * x1
    total += _e2m1_tiny((w >> 16) & 0xFF, HIGH) * x2 + _e2m1_tiny((w >> 24) & 0xFF, HIGH) * x3
    return total * _TWO_POW_112


@triton.jit
def _word_pair_dot_emulated(w0, w1, lo0, lo1, hi0, hi1, lo2, lo3, hi2, hi3):
    """`WORD_PAIR_DOT_PTX` (same operands, same order) in float32 Triton ops, for the
    interpreter, which runs no assembly."""
    sa = _word_dot_emulated(w0, lo0, lo1, False) + _word_dot_emulated(w1, lo2, lo3, False)
    sb = _word_dot_emulated(w0, hi0, hi1, True) + _word_dot_emulated(w1, hi2, hi3, True)
    return sa, sb


@triton.jit
def _tile_dot(w, x_row, base, tile_ok, ASM: tl.constexpr):
    """The two block sums of a row's 64-value tiles against the activations.

    w: [BN, U, 8] int32, each row's words of U tiles; x_row: fp16 pointer to the token's
    permuted, scaled activation row; base: [U, 4] int32, the natural K index of the first
    value of word pair i (64 * tile + 8i); tile_ok: [U], which tiles exist (the rest must be
    masked out of w as zeros). Returns the sums over each quad of words' low and high values
    (the tile's two scale blocks; quad j = word pairs 2j and 2j + 1), each [BN, U, 2] float32 in
    units of e2m1 * 2^-14 * x_row; the caller sums over quads once, after its loop. ASM: the
    packed fp16 inline assembly; otherwise `_word_pair_dot_emulated` on the same operands (the
    interpreter's path).
    """
    w0, w1 = tl.split(tl.reshape(w, (w.shape[0], w.shape[1], 4, 2)))  # words 2i and 2i+1
    # Word pair i's activation pairs: int32 words base/2 + 0..3 for its low values and
    # base/2 + 16..19 for its high ones (`_permuted` put them in the order the decode makes).
    x32 = x_row.to(tl.pointer_type(tl.int32)) + (base // 2)[:, :, None] + tl.arange(0, 4)[None, None, :]
    lo0, lo1, lo2, lo3 = _four_words(x32, tile_ok)
    hi0, hi1, hi2, hi3 = _four_words(x32 + 16, tile_ok)
    # Word pairs 2j (p) and 2j+1 (q) side by side: [.., 4] -> [.., 2] each; word 2i's low x
    # pairs, its high x pairs, then word 2i+1's, for each.
    wp0, wq0 = _even_odd(w0)
    wp1, wq1 = _even_odd(w1)
    p0, q0 = _even_odd_rows(lo0, wp0.shape)
    p1, q1 = _even_odd_rows(lo1, wp0.shape)
    p2, q2 = _even_odd_rows(hi0, wp0.shape)
    p3, q3 = _even_odd_rows(hi1, wp0.shape)
    p4, q4 = _even_odd_rows(lo2, wp0.shape)
    p5, q5 = _even_odd_rows(lo3, wp0.shape)
    p6, q6 = _even_odd_rows(hi2, wp0.shape)
    p7, q7 = _even_odd_rows(hi3, wp0.shape)
    if ASM:
        sa, sb = tl.inline_asm_elementwise(
            _WORD_QUAD_DOT,
            "=f,=f,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [wp0, wp1, wq0, wq1, p0, p1, p2, p3, p4, p5, p6, p7, q0, q1, q2, q3, q4, q5, q6, q7],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        pa, pb = _word_pair_dot_emulated(wp0, wp1, p0, p1, p2, p3, p4, p5, p6, p7)
        qa, qb = _word_pair_dot_emulated(wq0, wq1, q0, q1, q2, q3, q4, q5, q6, q7)
        sa, sb = pa + qa, pb + qb
    return sa, sb


@triton.jit
def _even_odd(w):
    """[BN, U, 4] -> entries 0, 2 and entries 1, 3 of the last axis, each [BN, U, 2]."""
    return tl.split(tl.reshape(w, (w.shape[0], w.shape[1], 2, 2)))


@triton.jit
def _even_odd_rows(x, shape: tl.constexpr):
    """[U, 4] activation pairs -> entries 0, 2 and 1, 3 of the last axis, broadcast to `shape`
    ([BN, U, 2])."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))
    return tl.broadcast_to(even[None, :, :], shape), tl.broadcast_to(odd[None, :, :], shape)


@triton.jit
def _block_factor(scale):
    """2^(scale - 113): with 2^14 undoes the e2m1 * 2^-14 of `_tile_dot`'s sums. Exact for
    scale bytes up to 240 (weights up to 6 * 2^113); real checkpoints sit near 120."""
    return ((scale + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _swiglu(gate, up, limit, alpha):
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * gate * tl.sigmoid(alpha * gate)


@triton.jit
def _top_k_slot(logits_ptr, token, E, slot, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert id and routing weight of `slot` in token's top-k (ties: lowest id first). NaN
    logits pick no id (a NaN hidden state): the id is clamped to a real expert's, so that the
    GEMVs never address past the weights."""
    e = tl.arange(0, BLOCK_E)
    row = tl.load(logits_ptr + token * E + e, mask=e < E, other=float("-inf"))
    first = tl.max(row, axis=0)
    denom = 0.0
    chosen = 0
    chosen_logit = 0.0
    free = e < E  # experts not yet picked: a picked one is not picked again among -inf logits
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, row, float("-inf")), axis=0)
        idx = tl.min(tl.where(free & (row == best), e, BLOCK_E), axis=0)
        denom += tl.exp(best - first)
        chosen = tl.where(slot == i, idx, chosen)
        chosen_logit = tl.where(slot == i, best, chosen_logit)
        free = free & (e != idx)
    return tl.minimum(chosen, E - 1), tl.exp(chosen_logit - first) / denom


# ----------------------------------------------------------------------------- router


# The step's counts are not specialised on (divisible by 16, or 1): eager steps of other sizes
# would compile variants while serving (a 0.24 s stall at 64 streams, docs/benchmark-log.md).
@triton.jit(do_not_specialize=["T"])
def _router_partial_kernel(
    x_ptr,
    wr_ptr,
    partial_ptr,
    out_ptr,
    counters_ptr,
    T,
    H,
    E,
    stride_x,
    k_per_split,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OPERAND: tl.constexpr,
    PDL: tl.constexpr,
):
    """Router logits of BLOCK_T tokens over one split of the hidden dimension (grid axis 1):
    partial[split, t, e] = sum over k in the split of x[t, k] * Wr[e, k], float32. Also zeroes the
    tokens' fp32 output rows over the same range (for the atomic combine), and the first program
    the per-expert counters [2, E] the next kernels count into (no memset launch). Splitting H
    spreads a small batch's router over many multiprocessors instead of a few long loops."""
    wait_for_previous(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    if tl.program_id(0) + split == 0:
        tl.store(counters_ptr + e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e_ok)
        tl.store(counters_ptr + E + e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e_ok)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, H)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        xt = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(wr_ptr + e[None, :] * H + k[:, None], mask=e_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(xt.to(OPERAND), wt.to(OPERAND), acc)
        zeros = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        tl.store(out_ptr + t[:, None] * H + k[None, :], zeros, mask=t_ok[:, None] & k_ok[None, :])
    tl.store(partial_ptr + (split * T + t[:, None]) * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


# Counts not specialised on: see `_router_partial_kernel`.
@triton.jit(do_not_specialize=["T", "splits"])
def _route_top_k_kernel(
    partial_ptr,
    br_ptr,
    ids_ptr,
    gates_ptr,
    counts_ptr,
    valid_ptr,
    T,
    E,
    splits,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """Routing of BLOCK_T tokens from the router's partial sums (all BLOCK_S >= splits of them in
    one load): logits, top-k (ties: lowest id), softmax over the k. Writes ids [T, k] int32 and
    gates [T, k] float32 and adds the per-expert pair counts to counts [E]. valid_ptr: None, or
    the number of real tokens (int32 [1]); tokens past it are neither written nor counted."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    if valid_ptr is not None:  # an input of the graph, written before it started: no need to wait
        t_ok = t_ok & (t < tl.load(valid_ptr))
    wait_for_previous(PDL)
    e = tl.arange(0, BLOCK_E)
    sp = tl.arange(0, BLOCK_S)
    e_ok = e < E
    ptrs = partial_ptr + (sp[:, None, None] * T + t[None, :, None]) * E + e[None, None, :]
    mask = (sp < splits)[:, None, None] & t_ok[None, :, None] & e_ok[None, None, :]
    logits = tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=0)
    logits += tl.load(br_ptr + e, mask=e_ok, other=0.0)[None, :]

    slot = tl.arange(0, K_POW2)
    top_vals = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    free = tl.broadcast_to(e_ok[None, :], logits.shape)  # real experts not yet picked (-inf logits tie, too)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, logits, float("-inf")), axis=1)
        idx = tl.min(tl.where(free & (logits == best[:, None]), e[None, :], BLOCK_E), axis=1)  # ties: lowest id
        idx = tl.minimum(idx, E - 1)  # none (NaN logits): still a real expert, counted as such
        chosen = e[None, :] == idx[:, None]
        free = free & ~chosen
        top_vals = tl.where(slot[None, :] == i, best[:, None], top_vals)
        top_ids = tl.where(slot[None, :] == i, idx[:, None], top_ids)
        counts += tl.sum((chosen & t_ok[:, None]).to(tl.int32), axis=0)
    k_ok2 = slot[None, :] < TOP_K
    first = tl.max(tl.where(k_ok2, top_vals, float("-inf")), axis=1)
    p = tl.where(k_ok2, tl.exp(top_vals - first[:, None]), 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    out_off = t[:, None] * TOP_K + slot[None, :]
    mask = t_ok[:, None] & k_ok2
    tl.store(ids_ptr + out_off, top_ids, mask=mask)
    tl.store(gates_ptr + out_off, p, mask=mask)
    tl.atomic_add(counts_ptr + e, counts, mask=e_ok & (counts > 0), sem="relaxed")


@triton.jit
def _router_logits_kernel(
    x_ptr,
    wr_ptr,
    br_ptr,
    logits_ptr,
    out_ptr,
    xh_ptr,
    inv_scale_ptr,
    H,
    E,
    stride_x,
    k_pad,
    delta_ptr,
    norm_ptr,
    res_ptr,
    stride_d,
    eps,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SLICE: tl.constexpr,
    ADD_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """logits[t, e] = h[t] . Wr[e] + br[e] for BLOCK_E experts of one token (float32): many small
    programs, so a decode step's router read is spread over the GPU, not one multiprocessor.
    Each loads its whole row (BLOCK_H >= H) and its router rows at once: one round of loads.
    h is x, or with ADD_NORM the residual add and RMSNorm that precede the MoE, done here
    instead of in a launch of their own: r = x + delta (rounded to x's dtype; the first program
    stores it to res[t]) and h = norm_weight * r * rsqrt(mean(r^2) + eps) rounded to x's dtype,
    as `add_rms_norm_reference` computes them.

    Each program also handles SLICE columns of the token for the GEMVs: zeroes them in the fp32
    output row, and writes them to xh[t] ([T, k_pad] fp16, `_permuted` order, zero past H) as
    h * c, where c = 2^k puts max |h[t]| in [2^14, 2^15); the first program writes 1/c to
    inv_scale[t]."""
    eb = tl.program_id(0)
    t = tl.program_id(1)
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    k = tl.arange(0, BLOCK_H)
    k_ok = k < H
    wr = tl.load(wr_ptr + e[:, None] * H + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
    cols = eb * SLICE + tl.arange(0, SLICE)  # this program's slice of h, for the GEMVs
    ok = cols < H
    bias = tl.load(br_ptr + e, mask=e_ok, other=0.0)
    if ADD_NORM:
        norm_row = tl.load(norm_ptr + k, mask=k_ok, other=0.0)
        norm_slice = tl.load(norm_ptr + cols, mask=ok, other=0.0)
    wait_for_previous(PDL)  # (the router and norm weights are nobody's output)
    # The slice is loaded again beside the row, not after the reductions: a slice of a register
    # tensor is not expressible, and a reload there would be one more round trip in series.
    x = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0)
    xs = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0)
    if ADD_NORM:
        x = residual_add(x, tl.load(delta_ptr + t * stride_d + k, mask=k_ok, other=0.0))
        xs = residual_add(xs, tl.load(delta_ptr + t * stride_d + cols, mask=ok, other=0.0))
        if eb == 0:
            tl.store(res_ptr + t * H + k, x, mask=k_ok)
        rstd = rms_rstd(x, H, eps)
        h = rms_scaled(x, norm_row, rstd).to(tl.float32)
    else:
        h = x.to(tl.float32)
    logits = tl.sum(wr.to(tl.float32) * h[None, :], axis=1) + bias
    tl.store(logits_ptr + t * E + e, logits, mask=e_ok)
    # max |h| < 2^(f - 126) for its exponent field f, so c = 2^(141 - f) (clamped to normal floats).
    field = (tl.max(tl.abs(h), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    k_exp = tl.minimum(tl.maximum(141 - field, -126), 126)
    c = ((k_exp + 127) << 23).to(tl.float32, bitcast=True)
    if eb == 0:
        tl.store(inv_scale_ptr + t, ((127 - k_exp) << 23).to(tl.float32, bitcast=True))
    if ADD_NORM:
        xs = rms_scaled(xs, norm_slice, rstd)
    tl.store(xh_ptr + t * k_pad + _permuted(cols), (xs.to(tl.float32) * c).to(tl.float16), mask=cols < k_pad)
    tl.store(out_ptr + t * H + cols, tl.zeros([SLICE], dtype=tl.float32), mask=ok)


# ----------------------------------------------------------------------------- decode (GEMV)
# What limits these at small T is loads in flight, not bandwidth or instruction issue: a
# batch-1 layer is a few microseconds of work per SM. Hence many small one-warp programs
# (`MoEKernelConfig`), software-pipelined loads, and few instructions per weight: `_tile_dot`
# multiplies packed fp16 pairs, with the activations scaled into fp16's range (x by the router
# kernel, act by the gate_up GEMV), and each 32-value block's sum gets its scale once.


@triton.jit
def _gemv_step(
    acc,
    w_rows,
    s_rows,
    x_row,
    t0,
    num_tiles,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    ASM: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """acc [R, U, 2] += one loop step of a GEMV over BLOCK_U (even) tiles from tile t0 (even):
    w_rows [R, 1, 8] int32 pointers to R rows' first words in pair 0, s_rows [R, 1] to their
    scale words; CHUNK: words (of weights, and of scales) from one pair's rows of the group to
    the next pair's (R * 16, and R). MASKED: guard the tiles past num_tiles (a last, partial
    step); whole steps load unmasked, which made the batch-1 to 8 layer 2-6% faster (H200)."""
    u = tl.arange(0, BLOCK_U)
    if MASKED:
        tile_ok = t0 + u < num_tiles
    else:
        tile_ok = tl.full([BLOCK_U], 1, tl.int1)
    pair = t0 // 2 + u // 2
    w = tl.load(w_rows + (pair * CHUNK + (u % 2) * 8)[None, :, None], mask=tile_ok[None, :, None], other=0)
    HALF_U: tl.constexpr = BLOCK_U // 2
    h = t0 // 2 + tl.arange(0, HALF_U)
    if MASKED:
        words = tl.load(s_rows + h[None, :] * (CHUNK // 16), mask=(2 * h < num_tiles)[None, :], other=0)  # [R, U/2]
    else:
        words = tl.load(s_rows + h[None, :] * (CHUNK // 16))
    words = tl.reshape(tl.broadcast_to(words[:, :, None], [s_rows.shape[0], HALF_U, 2]), [s_rows.shape[0], BLOCK_U])
    shift = ((u % 2) * 16)[None, :]
    base = (t0 + u)[:, None] * 64 + 8 * tl.arange(0, 4)[None, :]
    sa, sb = _tile_dot(w, x_row, base, tile_ok, ASM)
    s_a = _block_factor((words >> shift) & 0xFF)
    s_b = _block_factor((words >> (shift + 8)) & 0xFF)
    return acc + sa * s_a[:, :, None] + sb * s_b[:, :, None]


@triton.jit
def _gemv_loop(
    acc,
    w_rows,
    s_rows,
    x_row,
    num_tiles,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,
):
    """acc += a GEMV over all num_tiles K tiles (`_gemv_step`'s arguments): the whole steps
    unmasked, pipelined STAGES deep, then the partial last step, if any, masked. The callers
    pass the tiles of whole pairs (the layout's zero padding included, against activations
    padded with zeros), so with 2-tile steps there is no partial step: one issued after the
    pipeline has drained waits a whole memory round trip of its own, 0.4-0.6 us a GEMV at 45
    tiles (H200, docs/benchmark-log.md)."""
    full = num_tiles // BLOCK_U * BLOCK_U
    for t0 in tl.range(0, full, BLOCK_U, num_stages=STAGES):
        acc = _gemv_step(acc, w_rows, s_rows, x_row, t0, num_tiles, CHUNK, BLOCK_U, ASM, False)
    if full < num_tiles:
        acc = _gemv_step(acc, w_rows, s_rows, x_row, full, num_tiles, CHUNK, BLOCK_U, ASM, True)
    return acc


@triton.jit
def _gemv_gate_up_kernel(
    xh_ptr,
    inv_scale_ptr,
    logits_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    act_ptr,
    valid_ptr,
    I,
    E,
    E0,
    E_LOCAL,
    num_tiles,
    num_pairs,
    k_pad,
    i_pad,
    limit,
    alpha,
    act_scale,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_U: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[p, n] = act_scale * swiglu(x[t] W1g[e]^T + b, x[t] W1u[e]^T + b) in fp16, `_permuted`,
    for pair p = (token t, slot), e the slot's expert, n in this program's row group (8 columns;
    groups past I/8 write the zeros of i_pad's padding); BLOCK_U 64-value K tiles per step.
    w_ptr / s_ptr: the weights as int32 words, the scale words; xh_ptr: x as the router kernel
    scales it ([T, k_pad] fp16). valid_ptr: None, or the number of real tokens (int32 [1]); the
    programs of the rest return right after the wait, leaving their act rows unwritten. E0,
    E_LOCAL: the experts held (of the router's E); a pair routed elsewhere returns too."""
    pair = tl.program_id(0)
    group = tl.program_id(1)
    if valid_ptr is not None:
        valid = tl.load(valid_ptr)  # an input of the graph: its load overlaps the wait
        wait_for_previous(PDL)
        if pair // TOP_K >= valid:
            return
    else:
        wait_for_previous(PDL)
    n = group * _GROUP + tl.arange(0, _GROUP)
    if group * _GROUP >= I:
        tl.store(act_ptr + pair * i_pad + _permuted(n), tl.zeros([_GROUP], dtype=tl.float16), mask=n < i_pad)
        return
    token = pair // TOP_K
    e, _ = _top_k_slot(logits_ptr, token, E, pair % TOP_K, TOP_K, BLOCK_E)
    if (e < E0) | (e >= E0 + E_LOCAL):  # another rank's expert (expert parallelism)
        return
    e = e - E0
    chunk = (e.to(tl.int64) * (I // _GROUP) + group) * num_pairs  # this group's pair 0
    r = tl.arange(0, 2 * _GROUP)  # the group's 8 gate rows, then its 8 up rows: one chunk
    CHUNK: tl.constexpr = 2 * _GROUP * 16  # int32 words of a pair's gate and up rows
    rows = w_ptr + chunk * CHUNK + (r * 16)[:, None, None] + tl.arange(0, 8)[None, None, :]
    s_rows = s_ptr + chunk * (CHUNK // 16) + r[:, None]
    x_row = xh_ptr + token.to(tl.int64) * k_pad
    # What the epilogue reads is loaded before the loop, so that it is not one more round trip
    # after it.
    inv_scale = tl.load(inv_scale_ptr + token)
    gate_bias = tl.load(b_ptr + e * 2 * I + n)
    up_bias = tl.load(b_ptr + e * 2 * I + I + n)
    acc = _gemv_loop(
        tl.zeros([2 * _GROUP, BLOCK_U, 2], dtype=tl.float32),
        rows,
        s_rows,
        x_row,
        num_tiles,
        CHUNK,
        BLOCK_U,
        STAGES,
        ASM,
    )
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [16]: gates, then ups
    gate_sum, up_sum = tl.split(tl.permute(tl.reshape(y, [2, _GROUP]), [1, 0]))
    gate = gate_sum * inv_scale + gate_bias
    up = up_sum * inv_scale + up_bias
    act = _swiglu(gate, up, limit, alpha) * act_scale
    tl.store(act_ptr + pair * i_pad + _permuted(n), act.to(tl.float16))


@triton.jit
def _gemv_down_kernel(
    act_ptr,
    logits_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    valid_ptr,
    H,
    E,
    E0,
    E_LOCAL,
    num_tiles,
    num_pairs,
    i_pad,
    inv_act_scale,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_U: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, n] += gate * (act[p] W2[e]^T + b2[e]) for pair p = (token t, slot) and the 8
    columns n of this program's row group, fp32 atomics. act_ptr: the gate_up GEMV's fp16
    output ([T*k, i_pad], scaled by 1 / inv_act_scale).
    PDL (`dependent_launch`): launched as the gate_up GEMV's dependent, the program picks its
    expert from the router's logits (complete before the gate_up GEMV started) before it waits
    for act. valid_ptr, E0, E_LOCAL: as in the gate_up GEMV; only the real tokens' rows get the
    pairs of the experts held."""
    pair = tl.program_id(0)
    group = tl.program_id(1)
    if valid_ptr is not None:
        if pair // TOP_K >= tl.load(valid_ptr):
            return
    n = group * _GROUP + tl.arange(0, _GROUP)
    token = pair // TOP_K
    e, gate = _top_k_slot(logits_ptr, token, E, pair % TOP_K, TOP_K, BLOCK_E)
    if (e < E0) | (e >= E0 + E_LOCAL):
        return
    e = e - E0
    chunk = (e.to(tl.int64) * (H // _GROUP) + group) * num_pairs
    r = tl.arange(0, _GROUP)
    CHUNK: tl.constexpr = _GROUP * 16
    rows = w_ptr + chunk * CHUNK + (r * 16)[:, None, None] + tl.arange(0, 8)[None, None, :]
    s_rows = s_ptr + chunk * (CHUNK // 16) + r[:, None]
    bias = tl.load(b_ptr + e * H + n)  # a weight: read before the wait, not after the loop
    wait_for_previous(PDL)
    a_row = act_ptr + pair.to(tl.int64) * i_pad
    acc = _gemv_loop(
        tl.zeros([_GROUP, BLOCK_U, 2], dtype=tl.float32), rows, s_rows, a_row, num_tiles, CHUNK, BLOCK_U, STAGES, ASM
    )
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * inv_act_scale + bias
    tl.atomic_add(out_ptr + token * H + n, gate * y, sem="relaxed")


# ----------------------------------------------------------------------------- grouped (prefill)


# Counts not specialised on: see `_router_partial_kernel`.
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _align_kernel(
    ids_ptr,
    counts_ptr,
    cursor_ptr,
    sorted_ptr,
    block_expert_ptr,
    valid_ptr,
    num_pairs,
    E,
    max_blocks,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """Group (token, slot) pairs by expert: sorted[row] = pair (or -1 for padding), each expert's
    rows starting at a multiple of BLOCK_M; block_expert[b] = the expert of rows
    [b*BLOCK_M, (b+1)*BLOCK_M), -1 past the last. Order within an expert is arbitrary (atomics).
    valid_ptr: None, or the number of real tokens (int32 [1]): the pairs of the rest are left out.
    """
    pid = tl.program_id(0)
    pairs = num_pairs
    if valid_ptr is not None:  # (read before the wait, as in `_route_top_k_kernel`)
        pairs = tl.minimum(pairs, tl.load(valid_ptr) * TOP_K)
    wait_for_previous(PDL)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < pairs
    pe = tl.load(ids_ptr + p, mask=p_ok, other=0)
    start = tl.sum(tl.where(pe[:, None] == e[None, :], starts[None, :], 0), axis=1)
    rank = tl.atomic_add(cursor_ptr + pe, 1, mask=p_ok, sem="relaxed")
    tl.store(sorted_ptr + start + rank, p, mask=p_ok)
    if pid == 0:
        r = tl.arange(0, BLOCK_M)
        pad_mask = e_ok[:, None] & (r[None, :] < (padded - counts)[:, None])
        tl.store(sorted_ptr + (starts + counts)[:, None] + r[None, :], -1, mask=pad_mask)
        for b0 in range(0, max_blocks, BLOCK_P):
            b = b0 + tl.arange(0, BLOCK_P)
            done = (ends[None, :] <= (b * BLOCK_M)[:, None]) & e_ok[None, :]
            expert = tl.sum(done.to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(expert < E, expert, -1), mask=b < max_blocks)


@triton.jit
def _block_rows(sorted_ptr, mb, BLOCK_M: tl.constexpr, NARROW: tl.constexpr):
    """Whether block mb's real rows all sit in its first half: an expert's padding rows (-1)
    come after its pairs, so one load at the middle tells. Such a block runs its MMAs BLOCK_M / 2
    tokens wide: the same weights dequantised once, half the tensor-core work and activation
    loads. (Smaller blocks instead would dequantise an expert's weights once a block.)"""
    if NARROW:
        return tl.load(sorted_ptr + mb * BLOCK_M + BLOCK_M // 2) < 0
    return False


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr,
    sorted_ptr,
    block_expert_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    act_ptr,
    H,
    I,
    E0,
    E_LOCAL,
    num_tiles,
    num_pairs,
    stride_x,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LARGE_SCALES: tl.constexpr,
    PACKED: tl.constexpr,
    OPERAND: tl.constexpr,
    NARROW: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[rows, n] = swiglu(gate, up) for one BLOCK_M-row block of one expert's pairs.

    Computed transposed, [BLOCK_N weight rows, BLOCK_M tokens], so the dequantised weights are
    the MMA's register operand and the gathered activations its shared-memory one. The bytes
    and scales are loaded in the operand's register layout and dequantised there (no shared-
    memory round trip); scales as 32-bit words (a tile pair's 4 bytes), which the pipeliner can
    copy ahead like the weights. E0, E_LOCAL: the experts held; blocks of the others (and past
    the last, -1) return at once. NARROW: a block whose pairs fill at most half of it runs
    half as wide (`_block_rows`); its other rows of act are left unwritten.
    """
    wait_for_previous(PDL)
    mb = tl.program_id(1)
    e = tl.load(block_expert_ptr + mb)
    if (e < E0) | (e >= E0 + E_LOCAL):
        return
    e = (e - E0).to(tl.int64)
    args = (x_ptr, sorted_ptr, w_ptr, s_ptr, b_ptr, act_ptr, H, I, e, mb * BLOCK_M, num_tiles, num_pairs)
    if _block_rows(sorted_ptr, mb, BLOCK_M, NARROW):
        _gate_up_block(*args, stride_x, limit, alpha, TOP_K, BLOCK_M // 2, BLOCK_N, LARGE_SCALES, PACKED, OPERAND)
    else:
        _gate_up_block(*args, stride_x, limit, alpha, TOP_K, BLOCK_M, BLOCK_N, LARGE_SCALES, PACKED, OPERAND)


@triton.jit
def _gate_up_block(
    x_ptr,
    sorted_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    act_ptr,
    H,
    I,
    e,
    row0,
    num_tiles,
    num_pairs,
    stride_x,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LARGE_SCALES: tl.constexpr,
    PACKED: tl.constexpr,
    OPERAND: tl.constexpr,
):
    """`_grouped_gate_up_kernel`'s work on rows [row0, row0 + ROWS) of the sorted pairs, expert e
    (int64, among those held)."""
    rows = row0 + tl.arange(0, ROWS)
    pair = tl.load(sorted_ptr + rows)
    valid = pair >= 0
    token = tl.where(valid, pair // TOP_K, 0)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    j = tl.arange(0, 32)
    # Row n's pair-0 chunk: group n // 8 of 16 rows (8 gates, then their 8 ups), 64 bytes a row.
    CHUNK: tl.constexpr = 2 * _GROUP
    chunk = (e * (I // _GROUP) + n // _GROUP) * num_pairs * CHUNK + n % _GROUP  # in rows
    g_rows = w_ptr + chunk.to(tl.int64)[:, None] * 64 + j[None, :]
    u_rows = g_rows + _GROUP * 64
    sg = s_ptr + chunk
    su = sg + _GROUP
    x_rows = x_ptr + token.to(tl.int64)[None, :] * stride_x + j[:, None]
    gate_bias = tl.load(b_ptr + e * 2 * I + n, mask=n_ok, other=0.0)  # before the loop, not after it
    up_bias = tl.load(b_ptr + e * 2 * I + I + n, mask=n_ok, other=0.0)
    acc_g = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for step in range(0, num_tiles, 2):  # two tiles a step: the scale words' bytes at constant shifts
        sg_w = tl.load(sg + (step // 2) * CHUNK, mask=n_ok, other=0)
        su_w = tl.load(su + (step // 2) * CHUNK, mask=n_ok, other=0)
        for half in tl.static_range(2):
            tile = step + half
            w_ok = (n_ok & (n * 0 + tile < num_tiles))[:, None]  # (a tensor also under the interpreter)
            wg = tl.load(g_rows + (step // 2) * (CHUNK * 64) + half * 32, mask=w_ok, other=0)
            wu = tl.load(u_rows + (step // 2) * (CHUNK * 64) + half * 32, mask=w_ok, other=0)
            k = tile * 64 + j
            x_lo = tl.load(x_rows + tile * 64, mask=valid[None, :] & (k < H)[:, None], other=0.0).to(OPERAND)
            x_hi = tl.load(x_rows + tile * 64 + 32, mask=valid[None, :] & (k + 32 < H)[:, None], other=0.0).to(OPERAND)
            g_lo, g_hi = _dequant_tile(wg, sg_w >> (16 * half), PACKED, LARGE_SCALES, OPERAND)
            u_lo, u_hi = _dequant_tile(wu, su_w >> (16 * half), PACKED, LARGE_SCALES, OPERAND)
            acc_g = tl.dot(g_lo, x_lo, acc_g)
            acc_g = tl.dot(g_hi, x_hi, acc_g)
            acc_u = tl.dot(u_lo, x_lo, acc_u)
            acc_u = tl.dot(u_hi, x_hi, acc_u)
    gate = acc_g + gate_bias[:, None]
    up = acc_u + up_bias[:, None]
    act = _swiglu(gate, up, limit, alpha)
    dst = act_ptr + rows.to(tl.int64)[None, :] * I + n[:, None]
    tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _grouped_down_kernel(
    act_ptr,
    sorted_ptr,
    block_expert_ptr,
    gates_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    H,
    I,
    E0,
    E_LOCAL,
    num_tiles,
    num_pairs,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LARGE_SCALES: tl.constexpr,
    PACKED: tl.constexpr,
    OPERAND: tl.constexpr,
    NARROW: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, n] += gate * (act[row] W2[e]^T + b2[e]) for one block of one expert's rows
    (fp32 atomics: the k experts of a token meet in its output row, no extra pass). Loads and
    dequantises like `_grouped_gate_up_kernel` (E0, E_LOCAL and NARROW too: a narrow block reads
    only the rows of act that gate_up wrote)."""
    wait_for_previous(PDL)
    mb = tl.program_id(1)
    e = tl.load(block_expert_ptr + mb)
    if (e < E0) | (e >= E0 + E_LOCAL):
        return
    e = (e - E0).to(tl.int64)
    args = (act_ptr, sorted_ptr, gates_ptr, w_ptr, s_ptr, b_ptr, out_ptr, H, I, e, mb * BLOCK_M, num_tiles, num_pairs)
    if _block_rows(sorted_ptr, mb, BLOCK_M, NARROW):
        _down_block(*args, TOP_K, BLOCK_M // 2, BLOCK_N, LARGE_SCALES, PACKED, OPERAND)
    else:
        _down_block(*args, TOP_K, BLOCK_M, BLOCK_N, LARGE_SCALES, PACKED, OPERAND)


@triton.jit
def _down_block(
    act_ptr,
    sorted_ptr,
    gates_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    H,
    I,
    e,
    row0,
    num_tiles,
    num_pairs,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LARGE_SCALES: tl.constexpr,
    PACKED: tl.constexpr,
    OPERAND: tl.constexpr,
):
    """`_grouped_down_kernel`'s work on rows [row0, row0 + ROWS) of the sorted pairs, expert e."""
    rows = row0 + tl.arange(0, ROWS)
    pair = tl.load(sorted_ptr + rows)
    valid = pair >= 0
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    j = tl.arange(0, 32)
    chunk = (e * (H // _GROUP) + n // _GROUP) * num_pairs * _GROUP + n % _GROUP  # in rows
    w_rows = w_ptr + chunk.to(tl.int64)[:, None] * 64 + j[None, :]
    s_words = s_ptr + chunk
    a_rows = act_ptr + rows.to(tl.int64)[None, :] * I + j[:, None]
    gate = tl.load(gates_ptr + pair, mask=valid, other=0.0)  # the epilogue's reads, before the loop
    bias = tl.load(b_ptr + e * H + n, mask=n_ok, other=0.0)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for step in range(0, num_tiles, 2):
        s_w = tl.load(s_words + (step // 2) * _GROUP, mask=n_ok, other=0)
        for half in tl.static_range(2):
            tile = step + half
            w_ok = (n_ok & (n * 0 + tile < num_tiles))[:, None]
            w = tl.load(w_rows + (step // 2) * (_GROUP * 64) + half * 32, mask=w_ok, other=0)
            k = tile * 64 + j
            a_lo = tl.load(a_rows + tile * 64, mask=(k < I)[:, None], other=0.0).to(OPERAND)
            a_hi = tl.load(a_rows + tile * 64 + 32, mask=(k + 32 < I)[:, None], other=0.0).to(OPERAND)
            w_lo, w_hi = _dequant_tile(w, s_w >> (16 * half), PACKED, LARGE_SCALES, OPERAND)
            acc = tl.dot(w_lo, a_lo, acc)
            acc = tl.dot(w_hi, a_hi, acc)
    y = (acc + bias[:, None]) * gate[None, :]
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    tl.atomic_add(out_ptr + token[None, :] * H + n[:, None], y, mask=valid[None, :] & n_ok[:, None], sem="relaxed")


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class MoEKernelConfig:
    """Launch choices; the defaults are the fastest of `benchmarks/bench_moe.py --sweep` on an
    H200 (docs/benchmark-log.md, "MoE kernels")."""

    decode_max_tokens: int = 16  # T above this takes the grouped path
    # ... and so do batches with more (token, slot) pairs than this times the experts: the GEMVs
    # read an expert once a pair, the grouped path once. 20b (32 experts): T <= 8 (at 12 the
    # grouped path is 13% faster, at 16 28%); 120b (128): T <= 16 (GEMVs 12% faster at 16).
    # None: no such limit.
    decode_max_pairs_per_expert: float | None = 1.0
    # The grouped path's five kernels launch as programmatic dependents (`dependent_launch`) up
    # to this many tokens: +1.6% engine tok/s at 16 and 64 tokens, -0.5% at 128 and -3% for a
    # 2048-token prefill (H200, docs/benchmark-log.md).
    grouped_pdl_max_tokens: int = 64
    # GEMVs: small one-warp programs. They are latency-bound (few warps in flight), and many
    # small programs without cross-warp barriers keep more loads in flight than big ones.
    # A program takes one group of 8 output columns (ROW_GROUP, fixed by the layout): 8 down
    # rows, or gate_up's 8 gate and 8 up rows, one contiguous chunk a step.
    gemv_block_u: int = 2  # 64-value K tiles per loop step (2, 4, 8: whole tile pairs)
    gemv_warps: int = 1
    gemv_stages: int = 4
    router_block_k: int = 64  # grouped path router: hidden values per loop step
    router_programs: int = 64  # grouped path router: split H until about this many programs
    block_m: int | None = None  # grouped path tokens per block; None: by tokens per expert (`_block_m`)
    # Blocks of 32 or more whose pairs fill at most half of them run their MMAs half as wide
    # (`_block_rows`): an expert's last block, and at decode batches most blocks.
    narrow_blocks: bool = True
    block_n: int = 64  # grouped gate_up: weight rows (of gates, and as many of ups) per program
    warps: int = 4
    # grouped down: weight rows per program. 128 reads each activation tile half as often: up
    # to 3% faster than 64 at most sizes (20b 12-128 and 640-1,280 tokens, 120b 32-256 and
    # 3-4k), within 1.5% elsewhere (docs/benchmark-log.md).
    down_block_n: int = 128
    down_warps: int | None = None  # None: warps
    stages: int = 3  # grouped path: loop steps (of two K tiles) loaded ahead
    # Register caps a thread for the grouped gate_up and down kernels (None: the compiler's
    # choice): how many programs share a multiprocessor (`benchmarks/kernel_resources.py`).
    maxnreg: int | None = None
    down_maxnreg: int | None = None

    def __post_init__(self) -> None:
        u = self.gemv_block_u
        if u < 2 or u & (u - 1):
            raise ValueError(f"gemv_block_u must be a power of 2 of at least 2 (whole tile pairs), got {u}")


DEFAULT_CONFIG = MoEKernelConfig()


def takes_decode_path(t_count: int, top_k: int, num_experts: int, config: MoEKernelConfig = DEFAULT_CONFIG) -> bool:
    """Whether a batch of t_count tokens runs the decode GEMVs by its size (`fused_moe` also
    sends weights or limits outside the GEMVs' range to the grouped path)."""
    limit = config.decode_max_pairs_per_expert
    return t_count <= config.decode_max_tokens and (limit is None or t_count * top_k <= limit * num_experts)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gemv_activation_scale(swiglu_limit: float) -> float | None:
    """The power of two the decode GEMVs scale the SwiGLU output by before storing it in fp16:
    |act| <= max(limit, 0.3) * (limit + 1) (the gate is clamped above at limit, gate * sigmoid
    never goes below -0.17, up is clamped to +-limit), mapped under FP16_ACTIVATION_MAX. None
    when the limit is not positive or above GEMV_MAX_LIMIT (gpt-oss uses 7): such models take
    the grouped path."""
    if not 0 < swiglu_limit <= GEMV_MAX_LIMIT:
        return None
    bound = max(swiglu_limit, 0.3) * (swiglu_limit + 1)
    return 2.0 ** math.floor(math.log2(FP16_ACTIVATION_MAX / bound))


def _block_m(pairs: int, num_experts: int, config: MoEKernelConfig) -> int:
    if config.block_m is not None:
        return config.block_m
    # Room for 1.5x the mean pairs an expert: routing scatters the counts around the mean, and a
    # count past the block size dequantises the expert's weights twice, which costs more than
    # the MMA columns a half-empty block wastes (at 16 pairs an expert 32-token blocks beat 16
    # by 22%). 128-token blocks need twice the registers (half the programs resident); past 64
    # pairs an expert they dequantise each weight fewer times, and with the narrow blocks that
    # pays (20b at 80 / 96 / 128 / 160 pairs an expert: 6-8 / 10-12 / 3-6 / 2-3% faster, at 64
    # within 1%; 120b at 96-128 13-16% faster, at 40 11% slower; docs/benchmark-log.md).
    per_expert = pairs / num_experts
    if per_expert > 64:
        return 128
    return min(64, max(16, triton.next_power_of_2(math.ceil(1.5 * per_expert))))


def fused_moe(
    x: torch.Tensor,
    w: TritonMoEWeights,
    top_k: int,
    swiglu_limit: float,
    config: MoEKernelConfig = DEFAULT_CONFIG,
    out_dtype: torch.dtype | None = None,
    valid_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE block. x: [T, H] bf16, or float32 (float32 math throughout) -> [T, H] in out_dtype
    (default x's); float32 returns the kernels' own sums, with no cast kernel.

    valid_tokens: None, or int32 [1] on the device: only the first that many rows are real (a
    CUDA graph's step padded to its captured size). The rest route nowhere, so they cost no
    expert reads, and their output rows are zero."""
    return _moe(x, None, w, top_k, swiglu_limit, config, out_dtype, valid_tokens)[1]


def fused_add_norm_moe(
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: TritonMoEWeights,
    top_k: int,
    swiglu_limit: float,
    config: MoEKernelConfig = DEFAULT_CONFIG,
    out_dtype: torch.dtype | None = None,
    valid_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and RMSNorm before the MoE block, then the block: returns (r, MoE(h))
    with r = x + delta and h = rmsnorm(r) * norm_weight, as `add_rms_norm_reference`. The
    decode path does the add and norm in its router kernel (a launch fewer a layer); larger
    batches run `add_rms_norm_triton` first. valid_tokens: as in `fused_moe` (the add and norm
    still cover every row)."""
    if delta.shape != x.shape:
        raise ValueError(f"delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    return _moe(x, (delta, norm_weight, eps), w, top_k, swiglu_limit, config, out_dtype, valid_tokens)


def decode_router(
    x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, out32: torch.Tensor, add_norm=None
):
    """The decode path's router, one launch, for router_weight [E, H] (as loaded) and
    router_bias [E] float32: (residual or None, logits [T, E] float32, x as the
    GEMVs read it [T, K_pad] fp16 (scaled by a power of two, `_permuted`), the inverse scales
    [T] float32). It also zeroes out32 [T, H] (float32, the down GEMV's atomics add into it).
    add_norm: None, or (delta, norm weight, eps): then x is the residual stream, and the
    kernel first adds delta and applies the RMSNorm (the new residual is returned)."""
    x = x.contiguous()
    t_count, hidden = x.shape
    num_experts, dev = router_weight.shape[0], x.device
    k_pad = triton.cdiv(hidden, 128) * 128  # whole tile pairs, zeros past H: see `_gemv_loop`
    logits = torch.empty(t_count, num_experts, dtype=torch.float32, device=dev)
    x_half = torch.empty(t_count, k_pad, dtype=torch.float16, device=dev)  # h * 2^k, permuted
    inv_scale = torch.empty(t_count, dtype=torch.float32, device=dev)
    # 4 experts a program on 4 warps: at T = 8 the 120b router with its add + norm took 3.0-3.1
    # us against 3.7 for 2 experts on 8 warps, and at T = 1 the same 2.1-2.3 us
    # (`experiments/bench_router.py`, H200, docs/benchmark-log.md).
    experts_per_program = 4
    programs = triton.cdiv(num_experts, experts_per_program)
    residual, (delta, norm_weight, eps) = None, add_norm or (x, x, 0.0)
    if add_norm:
        delta = delta.contiguous()
        residual = torch.empty_like(x)
    _router_logits_kernel[(programs, t_count)](
        x,
        router_weight,
        router_bias,
        logits,
        out32,
        x_half,
        inv_scale,
        hidden,
        num_experts,
        x.stride(0),
        k_pad,
        delta,
        norm_weight,
        x if residual is None else residual,
        delta.stride(0),
        eps,
        BLOCK_E=experts_per_program,
        BLOCK_H=triton.next_power_of_2(hidden),
        SLICE=triton.next_power_of_2(triton.cdiv(k_pad, programs)),
        ADD_NORM=add_norm is not None,
        num_warps=4,
        **pdl_options(dev, dependent=True),
    )
    return residual, logits, x_half, inv_scale


def _moe(x, add_norm, w, top_k, swiglu_limit, config, out_dtype, valid_tokens=None):
    """(residual or None, MoE output); add_norm: None or (delta, norm weight, eps)."""
    if valid_tokens is not None and (valid_tokens.dtype != torch.int32 or valid_tokens.numel() != 1):
        raise ValueError("valid_tokens must be an int32 tensor of one element")
    t_count, hidden = x.shape
    # Routing is over the router's experts; the expert kernels skip those not held (E0, E_LOCAL).
    num_experts, inter = w.router_experts, w.intermediate_size
    e0, e_local = w.expert_offset, w.num_experts
    if hidden != w.hidden_size:
        raise ValueError(f"x has hidden size {hidden}, the weights {w.hidden_size}")
    out_dtype = out_dtype or x.dtype
    if t_count == 0:
        return (x if add_norm else None), torch.empty_like(x, dtype=out_dtype)
    x = x.contiguous()
    dev = x.device
    cfg = config
    pairs = t_count * top_k
    tiles1, tiles2 = triton.cdiv(hidden, 64), triton.cdiv(inter, 64)  # 64-value K tiles
    pairs1, pairs2 = w.w1.shape[2], w.w2.shape[2]
    block_e = triton.next_power_of_2(max(num_experts, 16))
    out32 = torch.empty(t_count, hidden, dtype=torch.float32, device=dev)  # zeroed by the router

    act_scale = gemv_activation_scale(swiglu_limit)
    if takes_decode_path(t_count, top_k, num_experts, cfg) and act_scale is not None and w.max_scale <= GEMV_MAX_SCALE:
        i_pad = pairs2 * 128  # whole tile pairs, zeros past I (the gate_up programs past I write them)
        residual, logits, x_half, inv_scale = decode_router(x, w.router_weight, w.router_bias, out32, add_norm)
        if persistent.applies(x, num_experts, hidden, inter, top_k):
            persistent.moe_after_router(
                x_half, inv_scale, logits, w, out32, valid_tokens, top_k, swiglu_limit, SWIGLU_ALPHA, act_scale
            )
            return residual, out32.to(out_dtype)
        k_pad = x_half.shape[1]
        act = torch.empty(pairs, i_pad, dtype=torch.float16, device=dev)  # * act_scale, permuted
        asm = not interpreting()
        gemv = dict(
            TOP_K=top_k,
            BLOCK_E=block_e,
            BLOCK_U=cfg.gemv_block_u,
            STAGES=cfg.gemv_stages,
            ASM=asm,
            num_warps=cfg.gemv_warps,
        )
        _gemv_gate_up_kernel[(pairs, i_pad // ROW_GROUP)](
            x_half,
            inv_scale,
            logits,
            w.w1.view(torch.int32),
            w.s1,
            w.b1,
            act,
            valid_tokens,
            inter,
            num_experts,
            e0,
            e_local,
            2 * pairs1,
            pairs1,
            k_pad,
            i_pad,
            swiglu_limit,
            SWIGLU_ALPHA,
            act_scale,
            **gemv,
            **pdl_options(dev, dependent=False),
        )
        _gemv_down_kernel[(pairs, hidden // ROW_GROUP)](
            act,
            logits,
            w.w2.view(torch.int32),
            w.s2,
            w.b2,
            out32,
            valid_tokens,
            hidden,
            num_experts,
            e0,
            e_local,
            2 * pairs2,
            pairs2,
            i_pad,
            1.0 / act_scale,
            **gemv,
            **pdl_options(dev, dependent=True),
        )
        return residual, out32.to(out_dtype)  # no copy when float32 was asked for

    residual = None
    if add_norm:
        delta, norm_weight, eps = add_norm
        residual, x = add_rms_norm_triton(x, delta.contiguous(), norm_weight, eps)
    # Float32 models (and the interpreter, which has no bf16 math) keep float32 MMA operands
    # and activations; bf16 ones run bf16 MMAs on the packed dequantisation.
    full_precision = interpreting() or x.dtype == torch.float32
    operand = tl.float32 if full_precision else tl.bfloat16
    ids = torch.empty(t_count, top_k, dtype=torch.int32, device=dev)
    gates = torch.empty(t_count, top_k, dtype=torch.float32, device=dev)
    counters = torch.empty(2, num_experts, dtype=torch.int32, device=dev)  # counts, cursors; zeroed by the router
    # Router: split H so that a small batch still spreads over many programs (at 64 tokens one
    # program per 16 tokens walking all of H took 15 us, H200), then top-k from the partial sums.
    block_t, router_k = 16, cfg.router_block_k
    token_blocks = triton.cdiv(t_count, block_t)
    chunks = triton.cdiv(hidden, router_k)
    k_per_split = router_k * triton.cdiv(chunks, max(1, cfg.router_programs // token_blocks))
    splits = triton.cdiv(hidden, k_per_split)
    partial = torch.empty(splits, t_count, num_experts, dtype=torch.float32, device=dev)
    pdl = pdl_options(dev, dependent=t_count <= cfg.grouped_pdl_max_tokens)  # each waits first thing
    _router_partial_kernel[(token_blocks, splits)](
        x,
        w.router_weight,
        partial,
        out32,
        counters,
        t_count,
        hidden,
        num_experts,
        x.stride(0),
        k_per_split,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=router_k,
        OPERAND=operand,
        **pdl,
    )
    top_k_block_t = 4  # small programs: the loads of all splits are one wide load each
    _route_top_k_kernel[(triton.cdiv(t_count, top_k_block_t),)](
        partial,
        w.router_bias,
        ids,
        gates,
        counters[0],
        valid_tokens,
        t_count,
        num_experts,
        splits,
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        BLOCK_T=top_k_block_t,
        BLOCK_E=block_e,
        BLOCK_S=triton.next_power_of_2(splits),
        **pdl,
    )
    block_m = _block_m(pairs, num_experts, cfg)
    max_blocks = min(pairs, (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    block_p = 128
    _align_kernel[(triton.cdiv(pairs, block_p),)](
        ids,
        counters[0],
        counters[1],
        sorted_pairs,
        block_expert,
        valid_tokens,
        pairs,
        num_experts,
        max_blocks,
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_P=block_p,
        **pdl,
    )
    act_dtype = torch.float32 if full_precision else torch.bfloat16
    act = torch.empty(max_blocks * block_m, inter, dtype=act_dtype, device=dev)
    packed = not full_precision and not w.large_scales  # `GROUPED_DEQUANT_PTX`: bf16, scale bytes <= 128
    common = dict(
        TOP_K=top_k,
        BLOCK_M=block_m,
        LARGE_SCALES=w.large_scales,
        PACKED=packed,
        OPERAND=operand,
        NARROW=cfg.narrow_blocks and block_m >= 32,  # (tl.dot's sizes start at 16)
        num_stages=cfg.stages,
        **pdl,
    )
    # Grids run the column blocks of one token block side by side (axis 0 is launched first):
    # they share its activation rows while those are in cache (4-5% faster at 2048 tokens, H200).
    _grouped_gate_up_kernel[(triton.cdiv(inter, cfg.block_n), max_blocks)](
        x,
        sorted_pairs,
        block_expert,
        w.w1,
        w.s1,
        w.b1,
        act,
        hidden,
        inter,
        e0,
        e_local,
        tiles1,
        pairs1,
        x.stride(0),
        swiglu_limit,
        SWIGLU_ALPHA,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.warps,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        **common,
    )
    _grouped_down_kernel[(triton.cdiv(hidden, cfg.down_block_n), max_blocks)](
        act,
        sorted_pairs,
        block_expert,
        gates,
        w.w2,
        w.s2,
        w.b2,
        out32,
        hidden,
        inter,
        e0,
        e_local,
        tiles2,
        pairs2,
        BLOCK_N=cfg.down_block_n,
        num_warps=cfg.down_warps or cfg.warps,
        **({"maxnreg": cfg.down_maxnreg} if cfg.down_maxnreg else {}),
        **common,
    )
    return residual, out32.to(out_dtype)
