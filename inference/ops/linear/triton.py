"""A Triton matmul for few-token (decode) batches: `y = x @ W^T + b` read at memory speed.

At decode a dense projection multiplies M = 1..16 token rows by a weight matrix of tens of MB:
the time is the time to stream W once. Each program owns BLOCK_N output columns (rows of W, the
nn.Linear layout, contiguous along K) and walks K in BLOCK_K steps with 16-byte loads, every x row
applied to each W element it loads, so W is read exactly once per M tile. Two inner products:

* "fma" (M = 1 only): `acc[BLOCK_N, BLOCK_K] += w * x` elementwise in float32 and one reduction
  over K at the end, so the loop body is loads and FMAs;
* "dot": x padded to BLOCK_M = 16 rows (masked rows are never loaded) and `tl.dot` on tensor
  cores; W goes through shared memory, which lets Triton pipeline its loads `num_stages` deep.

When N / BLOCK_N gives too few programs to keep every multiprocessor's loads in flight, K is
split: program (n, s) reduces K range s into float32 partials [S, M, N] and a second small kernel
sums the S partials in a fixed order, adds the bias and casts. That is deterministic (the same
bits every run, unlike float32 atomics whose order depends on scheduling) and needs no zeroed
output buffer (atomics would need a memset launch plus a cast launch anyway). Nothing syncs with
the host and all buffers come from the caching allocator, so every launch is CUDA-graph capturable.

On Hopper the kernel is launched as a programmatic dependent (`dependent_launch`): an M = 1
program loads its first W tile while the kernel before it (attention, or the add + norm) still
runs, then waits for x.

Launch shapes come from `linear_config(M, N, K, sm_count)`; `benchmarks/bench_dense.py --sweep`
measures the alternatives. `linear_reference` is the definition (float32 math) the kernel must
match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.ops.dependent_launch import pdl_options
from inference.ops.multiprocessors import multiprocessors

try:
    import triton
    import triton.language as tl

    from inference.ops.dependent_launch import wait_for_previous
except ImportError:  # the reference below needs no Triton
    triton = None

DOT_BLOCK_M = 16  # tl.dot's smallest tile side: x rows are padded (by masking) up to it


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] or None -> [M, N] in x's dtype, math in float32."""
    out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


@dataclass(frozen=True)
class LinearConfig:
    """One launch shape. `split_k`: how many K ranges (1 = no second pass); `dot`: the tl.dot
    inner product (required for M > 1) instead of the elementwise one."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False


# Heuristic knobs (see `linear_config`); starting points until `bench_dense.py --sweep` on an H200
# says otherwise.
PROGRAMS_PER_SM = 4  # enough resident programs per multiprocessor to keep its loads in flight
MIN_K_PER_SPLIT = 1024  # a split shorter than this costs more in the second pass than it hides


def _pow2_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def linear_config(m: int, n: int, k: int, sm_count: int) -> LinearConfig:
    """The launch shape for an [m, k] x [n, k]^T product on `sm_count` multiprocessors.

    M = 1: the fma inner product, BLOCK_N as small as needed (4..16) for PROGRAMS_PER_SM programs
    per multiprocessor (small tiles balance the load: no SM waits on a third program while others
    hold two), 512-wide K steps (8 KB of W per program per step at BLOCK_N 8), 1024-wide from
    K = 4096 at BLOCK_N 4 (o_proj: 9.0 against 9.5 us on an H200; qkv's K = 2880 stays faster at
    512; larger BLOCK_N keeps 512 so the float32 sums fit in registers).
    M > 1: tl.dot with BLOCK_N 32 (x rows reused over 32 W rows), 128-wide K steps pipelined 4 deep.
    Either way K is split (multiples of BLOCK_K, each >= MIN_K_PER_SPLIT) while there are fewer
    than PROGRAMS_PER_SM programs per multiprocessor.
    """
    want = PROGRAMS_PER_SM * sm_count
    if m == 1:
        # num_stages 1: latency is hidden by many resident programs, not by a shared-memory ring.
        block_n = min(16, max(4, _pow2_floor(max(1, n // want))))
        wide = k >= 4096 and block_n <= 4  # wider K steps only where the [BLOCK_N, BLOCK_K] sums stay small
        cfg = LinearConfig(block_n=block_n, block_k=1024 if wide else 512, num_warps=4, num_stages=1)
    else:
        cfg = LinearConfig(block_n=32, block_k=128, num_warps=4, num_stages=4, dot=True)
    programs = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, 1 if not cfg.dot else DOT_BLOCK_M)
    split = 1
    if programs < want:
        split = max(1, min(triton.cdiv(want, programs), k // MIN_K_PER_SPLIT))
    return LinearConfig(cfg.block_n, cfg.block_k, split, cfg.num_warps, cfg.num_stages, cfg.dot)


if triton is not None:

    @triton.jit
    def _linear_kernel(
        X,
        W,
        B,
        Y,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        stride_split,
        k_per_split,
        HAS_BIAS: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (n, s, m): rows [m*BLOCK_M, +BLOCK_M) of x times W rows [n*BLOCK_N, +BLOCK_N)
        over K range s. With SPLIT > 1, Y is the float32 partials [S, M, N] (split stride
        `stride_split`), written without bias; otherwise Y [M, N] gets bias added and the cast.
        PDL: `dependent_launch` bits; as a dependent, the M = 1 program loads its first W tile
        before it waits for x."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        n_ok = rows_n < N
        m_ok = rows_m < M
        k_start = pid_s * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        # k_per_split is a multiple of BLOCK_K, so a step never crosses into the next split: the
        # only K bound to mask is K itself (whose divisibility Triton knows, keeping loads wide).
        w_ptrs = W + rows_n.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        x_ptrs = X + rows_m.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        if HAS_BIAS and SPLIT == 1:  # a weight: read before the wait, not after the loop
            bias = tl.load(B + rows_n, mask=n_ok, other=0.0).to(tl.float32)
        if DOT:
            wait_for_previous(PDL)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                k_ok = (k0 + ks) < K
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        else:
            # The next W tile is loaded before the current one is used: a step of loads always in
            # flight (no shared-memory pipeline here, num_stages 1). Nobody writes W, so the first
            # tile is loaded before the wait for x (no split is empty). The masks are on K plus a
            # whole-step condition, which keeps the loads 16 bytes wide.
            w = tl.load(w_ptrs + k_start, mask=n_ok[:, None] & ((k_start + ks) < K)[None, :], other=0.0)
            wait_for_previous(PDL)
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
                more = n_ok & (rows_n * 0 + k0 + BLOCK_K < k_end)  # (a tensor also under the interpreter)
                w_next = tl.load(
                    w_ptrs + k0 + BLOCK_K, mask=more[:, None] & ((k0 + BLOCK_K + ks) < K)[None, :], other=0.0
                )
                acc2 += w.to(tl.float32) * x.to(tl.float32)  # x: [1, BLOCK_K], broadcast over rows
                w = w_next
            acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT > 1:
            ptrs = Y + pid_s * stride_split + rows_m[:, None] * stride_ym + rows_n[None, :]
            tl.store(ptrs, acc, mask=out_ok)
        else:
            if HAS_BIAS:
                acc += bias[None, :]
            ptrs = Y + rows_m[:, None] * stride_ym + rows_n[None, :]
            tl.store(ptrs, acc.to(Y.dtype.element_ty), mask=out_ok)

    @triton.jit
    def _split_k_reduce_kernel(
        P,
        B,
        Y,
        N,
        stride_split,
        stride_pm,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Y[m, cols] = sum over s of P[s, m, cols] (in order s = 0..SPLIT-1) + bias, cast."""
        m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(P + s * stride_split + m * stride_pm + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + m * stride_ym + cols, acc.to(Y.dtype.element_ty), mask=ok)


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Same contract as `linear_reference`: x [M, K] (rows with unit column stride), weight [N, K]
    (unit column stride, e.g. an nn.Linear weight or a tensor-parallel shard of one), bias [N]
    (bf16 or float32) or None -> y [M, N] in out_dtype (default x's), float32 accumulation (a
    tensor-parallel shard asks for float32: its partial sum is reduced before any rounding).

    `config` overrides the `linear_config` heuristic (the benchmark's sweep)."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"x has {k} columns, weight {tuple(weight.shape)} expects {k_w}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("linear_triton needs x and weight rows with unit column stride")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = config or linear_config(m, n, k, multiprocessors(x.device))
    if m > 1 and not cfg.dot:
        raise ValueError("the fma inner product handles one row; use dot=True for M > 1")
    block_m = DOT_BLOCK_M if cfg.dot else 1
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # rounding up the split length can leave fewer splits
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m))
    has_bias = bias is not None
    b = bias if has_bias else y  # never read
    target = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _linear_kernel[grid](
        x,
        weight,
        b,
        target,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        n,
        m * n,
        k_per_split,
        HAS_BIAS=has_bias,
        SPLIT=split,
        DOT=cfg.dot,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(x.device, dependent=True),
    )
    if split > 1:
        block = 1024
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            target,
            b,
            y,
            n,
            m * n,
            n,
            n,
            HAS_BIAS=has_bias,
            SPLIT=split,
            BLOCK=block,
            num_warps=4,
        )
    return y
