"""How many multiprocessors (SMs) a kernel's launch heuristics should fill."""

from __future__ import annotations

import functools

import torch

from inference.device import cuda_index


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The GPU's SM count; 4 off the GPU (Triton interpreter runs: any small number exercises the
    split paths)."""
    if device.type != "cuda":
        return 4
    return _sm_count(cuda_index(device))
