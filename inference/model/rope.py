"""YaRN rotary position embeddings as gpt-oss uses them (docs/design.md §1), "rotate half" style."""

from __future__ import annotations

import math

import torch

from inference.config import RopeConfig


def yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [head_dim/2] (float32) and the attention (mscale) factor."""
    base, factor = rope.theta, rope.factor
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1 - ramp  # high-frequency pairs keep their original frequency
    inv_freq = interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, attention_factor


def cos_sin_table(rope: RopeConfig, head_dim: int, max_positions: int, device=None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second, both scaled."""
    inv_freq, scale = yarn_inv_freq(rope, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos_sin rows [T, D] (see cos_sin_table), computed in float32."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
