"""The gpt-oss mixture-of-experts block: router, top-k, clamped SwiGLU experts (docs/design.md §1).

Expert weights come either packed in MXFP4 (HF layout, kept packed until used) or dense:
    packed: gate_up_blocks [E, 2I, H/32, 16] u8, gate_up_scales [E, 2I, H/32] u8,
            down_blocks    [E, H, I/32, 16] u8,  down_scales    [E, H, I/32] u8
    dense:  gate_up [E, H, 2I], down [E, I, H]  (HF's dequantized layout, x @ W)
    biases: gate_up_bias [E, 2I], down_bias [E, H]
gate/up are interleaved along 2I: gate = h[..., 0::2], up = h[..., 1::2].

`moe_reference` is the pure-torch path (float32 math); GPU kernels beside it (`triton.py`, `flashinfer.py`)
implement the same function and are tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.ops.mxfp4 import dequantize_mxfp4


@dataclass
class ExpertWeights:
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    gate_up_blocks: torch.Tensor | None = None
    gate_up_scales: torch.Tensor | None = None
    down_blocks: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None

    @property
    def is_mxfp4(self) -> bool:
        return self.gate_up_blocks is not None

    @property
    def num_experts(self) -> int:
        return self.gate_up_bias.shape[0]

    def expert_matrices(self, e: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's weights for x @ W: (gate_up [H, 2I], down [I, H])."""
        if self.is_mxfp4:
            w1 = dequantize_mxfp4(self.gate_up_blocks[e], self.gate_up_scales[e], dtype).t()
            w2 = dequantize_mxfp4(self.down_blocks[e], self.down_scales[e], dtype).t()
            return w1, w2
        return self.gate_up[e].to(dtype), self.down[e].to(dtype)


@dataclass
class MoEWeights:
    """One layer's MoE. Under expert parallelism `experts` holds experts [expert_offset,
    expert_offset + its count) of the router's E: a token routed elsewhere gets nothing here
    (another rank adds that expert's share)."""

    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor  # [E]
    experts: ExpertWeights
    expert_offset: int = 0


def route(x: torch.Tensor, weights: MoEWeights, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: logits over all experts, keep the top k, softmax over those k only.

    x: [T, H]. Returns (expert ids [T, k] int64, routing weights [T, k] float32).
    """
    logits = torch.nn.functional.linear(x, weights.router_weight.to(x.dtype), weights.router_bias.to(x.dtype))
    top_values, top_ids = torch.topk(logits, top_k, dim=-1)
    return top_ids, torch.softmax(top_values.float(), dim=-1)


def swiglu(h: torch.Tensor, limit: float, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved gate/up. h: [..., 2I] -> [..., I]."""
    gate, up = h[..., 0::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def moe_reference(
    x: torch.Tensor,
    weights: MoEWeights,
    top_k: int,
    swiglu_limit: float,
    alpha: float = 1.702,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The whole MoE block in float32 math. x: [T, H] -> [T, H] in out_dtype (default x's).
    With a subset of the experts (`MoEWeights.expert_offset`), their share of it."""
    expert_ids, routing = route(x, weights, top_k)
    xf = x.float()
    out = torch.zeros_like(xf)
    ex = weights.experts
    first, count = weights.expert_offset, ex.num_experts
    for e in torch.unique(expert_ids).tolist():
        if not first <= e < first + count:
            continue
        token_idx, slot = torch.where(expert_ids == e)
        w1, w2 = ex.expert_matrices(e - first)
        h = xf[token_idx] @ w1 + ex.gate_up_bias[e - first].float()
        y = swiglu(h, swiglu_limit, alpha) @ w2 + ex.down_bias[e - first].float()
        out.index_add_(0, token_idx, y * routing[token_idx, slot, None])
    return out.to(out_dtype or x.dtype)
