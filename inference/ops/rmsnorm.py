"""The residual add and the RMSNorm that follows it, fused into one pass over the hidden states.

Every gpt-oss layer does `x = x + sublayer(...)` and then normalises x for the next sublayer.
Unfused that is ~8 small kernels (add, upcast, square, mean, rsqrt, two multiplies, downcast) per
norm; at batch 1 each costs a few microseconds of launch and tail latency even inside a CUDA
graph, 48 norms a token. One program per row does it all here.

    residual = (x + delta) rounded to x's dtype       (what the unfused model stores; delta may
                                                       be float32, e.g. the MoE's own sums)
    normed   = weight * residual * rsqrt(mean(residual^2) + eps), math in float32, cast to x's dtype

`add_rms_norm_reference` is the pure-torch definition; `add_rms_norm_triton` must match it.
"""

from __future__ import annotations

import torch

from inference.ops.dependent_launch import pdl_options

try:
    import triton
    import triton.language as tl

    from inference.ops.dependent_launch import wait_for_previous
except ImportError:  # the reference below needs no Triton
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H]; normalised in float32, scaled, cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [T, H] -> (residual = x + delta, rms_norm(residual)), both [T, H] in x's dtype
    (a float32 delta is added in float32 and the sum rounded once)."""
    residual = (x + delta).to(x.dtype)
    return residual, rms_norm_reference(residual, weight, eps)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        X,
        Delta,
        W,
        Res,
        Out,
        H,
        stride_x,
        stride_d,
        eps,
        HAS_DELTA: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PDL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        w = tl.load(W + cols, mask=ok, other=0.0)  # a weight: read before the wait
        wait_for_previous(PDL)
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            x = residual_add(x, tl.load(Delta + row * stride_d + cols, mask=ok, other=0.0))
            tl.store(Res + row * H + cols, x, mask=ok)
        tl.store(Out + row * H + cols, rms_scaled(x, w, rms_rstd(x, H, eps)), mask=ok)

    # The fused add + norm's math, also used where other kernels fold it in (the MoE router).
    @triton.jit
    def residual_add(x, delta):
        """x + delta added in float32 and rounded to x's dtype, as the unfused `x + delta` stores it."""
        return (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)

    @triton.jit
    def rms_rstd(r, H, eps):
        """1 / sqrt(mean(r^2) + eps) over a whole row r (masked-off entries zero), float32."""
        rf = r.to(tl.float32)
        return 1.0 / tl.sqrt(tl.sum(rf * rf, axis=0) / H + eps)

    @triton.jit
    def rms_scaled(r, weight, rstd):
        """weight * r * rstd in float32, rounded to r's dtype (any slice of a row, given its rstd)."""
        return (weight.to(tl.float32) * (r.to(tl.float32) * rstd)).to(r.dtype)


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_rms_norm_reference`; with delta None, residual is x itself."""
    t, h = x.shape
    if x.stride(1) != 1 or (delta is not None and delta.stride(1) != 1):
        raise ValueError("add_rms_norm_triton needs rows with unit column stride")
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    residual = x if delta is None else torch.empty_like(out)
    if t:
        _add_rms_norm_kernel[(t,)](
            x,
            x if delta is None else delta,
            weight,
            residual,
            out,
            h,
            x.stride(0),
            0 if delta is None else delta.stride(0),
            eps,
            HAS_DELTA=delta is not None,
            BLOCK_H=triton.next_power_of_2(h),
            num_warps=4 if h <= 4096 else 8,
            **pdl_options(x.device, dependent=True),
        )
    return residual, out
