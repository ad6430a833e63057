"""Which matmul runs the attention projections: the Triton GEMV for decode-sized batches.

At decode a step multiplies a handful of token rows by each projection's weights, and the time is
reading the weights. `inference/ops/linear/triton.py` streams W in one pass. Measured on an
H200 (docs/benchmark-log.md, `benchmarks/bench_dense.py`), it wins for o_proj (4096 -> 2880): 9.0 us
against cuBLAS's 11.9 at 1 row (62% against 46% of copy bandwidth), and ahead up to 16 rows; and
for qkv (2880 -> 5120) at 1 row only (10.0 against 11.0 us; 14% behind at 2 to 16 rows). cuBLAS
keeps the rest, the lm_head (already at copy speed) and the router.

The model builds plain `nn.Linear`s (the CPU path never changes); `use_decode_gemv(model)`, called
by the loaders after the weights are in place, swaps the layers in DECODE_GEMV_LAYERS for
`DecodeLinear`s holding the same parameters (each with its own row limit), only where the kernel
can run: CUDA, Triton installed, bf16 weights. Tensor-parallel shards are ordinary smaller weights (o_proj input
columns) and take the same path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Most token rows the Triton kernel takes; more go to cuBLAS (the H200 crossover for o_proj).
GEMV_MAX_TOKENS = 16

# Attention sublayers swapped (attribute names on `model.Attention`) and the most token rows each
# sends to the kernel: where it measured faster.
DECODE_GEMV_LAYERS = {"qkv": 1, "o_proj": GEMV_MAX_TOKENS}


class DecodeLinear(nn.Linear):
    """An nn.Linear whose forward sends up to `max_tokens` rows of bf16 input through the Triton
    kernel and everything else through `F.linear`. x: [T, in_features] -> [T, out_features] in
    out_dtype (default x's; the kernel writes float32 sums unrounded, cuBLAS's are cast)."""

    max_tokens: int = GEMV_MAX_TOKENS

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self.max_tokens and x.dtype == torch.bfloat16 and x.stride(1) == 1:
            from inference.ops.linear.triton import linear_triton

            return linear_triton(x, self.weight, self.bias, out_dtype=out_dtype)
        y = F.linear(x, self.weight, self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    @classmethod
    def wrapping(cls, linear: nn.Linear, max_tokens: int = GEMV_MAX_TOKENS) -> "DecodeLinear":
        """A DecodeLinear sharing `linear`'s parameters (no copy)."""
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.max_tokens = max_tokens
        return layer


def gemv_supported(linear: nn.Linear) -> bool:
    """Whether the Triton kernel can run this layer: bf16 weights with unit column stride on CUDA,
    Triton installed."""
    from inference.ops.attention.backend import triton_available

    w = linear.weight
    return triton_available(w.device) and w.dtype == torch.bfloat16 and w.dim() == 2 and w.stride(1) == 1


def use_decode_gemv(model) -> int:
    """Swap each layer's DECODE_GEMV_LAYERS for DecodeLinears where supported; returns how many
    were swapped (0 on CPU, in float32, or without Triton)."""
    swapped = 0
    for block in model.layers:
        for name, max_tokens in DECODE_GEMV_LAYERS.items():
            linear = getattr(block.attn, name)
            if type(linear) is nn.Linear and gemv_supported(linear):
                setattr(block.attn, name, DecodeLinear.wrapping(linear, max_tokens))
                swapped += 1
    return swapped
