"""The GPU's device-to-device copy bandwidth, measured in the benchmark's own process: the
ceiling that SPEC §2's rooflines divide by."""

from __future__ import annotations

import torch


def copy_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * n / seconds
