"""The GPU's dense bf16 matrix-multiply rate, measured in the benchmark's own process: the
arithmetic ceiling of a step's roofline, beside `copy_bandwidth`'s memory one."""

from __future__ import annotations

import functools

import torch
from cuda_timing import window_seconds  # (benchmarks/, this module's folder)


def matmul_rate(n: int = 8192, iters: int = 20) -> float:
    """FLOP/s of an n x n x n bf16 matmul (2 n^3 FLOPs), the best cuBLAS does on square shapes."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(a)
    seconds = window_seconds(functools.partial(torch.matmul, a, b, out=out), iters, warmup=3)
    del a, b, out
    return 2 * n**3 / seconds
