"""Random gpt-oss MoE layers for the MoE kernel tests: checkpoint-layout MXFP4 experts made
directly on the device (random bytes, block scales 2^-10..2^-6 like a real checkpoint's)."""

from __future__ import annotations

import torch

from inference.ops.moe.reference import ExpertWeights, MoEWeights


def random_mxfp4_layer(
    num_experts: int,
    hidden: int,
    inter: int,
    seed: int = 0,
    device="cuda",
    router_dtype: torch.dtype = torch.bfloat16,
    bias_std: float = 0.1,
) -> MoEWeights:
    """One layer's router ([E, H] in `router_dtype`) and experts (gate_up [E, 2I, H/32, 16] and
    down [E, H, I/32, 16] blocks with their scales; float32 biases ~ N(0, bias_std))."""
    g = torch.Generator(device=device).manual_seed(seed)

    def u8(*shape, low=0, high=256):
        return torch.randint(low, high, shape, generator=g, device=device, dtype=torch.uint8)

    def normal(*shape, std):
        return torch.randn(shape, generator=g, device=device) * std

    e, h, i = num_experts, hidden, inter
    experts = ExpertWeights(
        gate_up_bias=normal(e, 2 * i, std=bias_std),
        down_bias=normal(e, h, std=bias_std),
        gate_up_blocks=u8(e, 2 * i, h // 32, 16),
        gate_up_scales=u8(e, 2 * i, h // 32, low=117, high=122),
        down_blocks=u8(e, h, i // 32, 16),
        down_scales=u8(e, h, i // 32, low=117, high=122),
    )
    return MoEWeights(
        router_weight=normal(e, h, std=h**-0.5).to(router_dtype),
        router_bias=normal(e, std=0.1).to(router_dtype),
        experts=experts,
    )
