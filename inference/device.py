"""Which CUDA device: the index a device names, and the calling thread's current device.

A `torch.device("cuda")` names no index: it means the current device, which CUDA keeps per host
thread. Triton launches a kernel on the current device whatever its tensors' device, so an
engine on another GPU than the first (a data-parallel replica, `--device cuda:1`) makes its
device current in every thread that builds or steps it.
"""

from __future__ import annotations

import torch


def cuda_index(device: torch.device) -> int:
    """The index of CUDA device `device`; the current device's where it names none."""
    return device.index if device.index is not None else torch.cuda.current_device()


def make_device_current(device: str | torch.device | None) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for the CPU, or for a
    CUDA device with no index, which already means the current one)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
