"""The GPU's device-to-device copy bandwidth, measured in the benchmark's own process: the
ceiling that docs/design.md §2's rooflines divide by."""

from __future__ import annotations

import functools

import torch
from cuda_timing import window_seconds  # (benchmarks/, this module's folder)


def copy_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = window_seconds(functools.partial(dst.copy_, src), iters, warmup=3)
    del src, dst
    return 2 * n / seconds
