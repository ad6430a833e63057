"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints store them.

`blocks` uint8 [..., G, 16]: each byte holds two e2m1 codes, low nibble first, so a row of G
blocks holds G*32 values. `scales` uint8 [..., G]: one shared power-of-two scale per block,
value = e2m1 * 2^(scale - 127).
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK_SIZE = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Unpack MXFP4 to real values.

    blocks: [..., G, 16] uint8; scales: [..., G] uint8. Returns [..., G * 32] in `dtype`, in the
    order the values appear along the packed axis (for expert weights: [E, out, in]).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS
    values = torch.ldexp(values, exponent).to(dtype)
    return values.flatten(-2)


def quantize_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round real values to MXFP4 (used to build test and benchmark checkpoints).

    weights: [..., N] with N a multiple of 32. Returns (blocks [..., N/32, 16] uint8,
    scales [..., N/32] uint8). Each block's scale is chosen so its largest magnitude fits 6.0.
    """
    *prefix, n = weights.shape
    if n % BLOCK_SIZE:
        raise ValueError(f"last dimension {n} is not a multiple of {BLOCK_SIZE}")
    w = weights.float().reshape(*prefix, n // BLOCK_SIZE, BLOCK_SIZE)
    amax = w.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = w / torch.exp2(exponent).unsqueeze(-1)
    grid = torch.tensor(E2M1_VALUES[:8], device=w.device)
    codes = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)  # magnitude code 0..7
    codes = codes | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
