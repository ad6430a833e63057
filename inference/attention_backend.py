"""Which attention implementation the model runs: chosen once per model, by device.

Every backend has the same two methods:
    attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window) -> [T, Hq, D]
        (contract: `inference.attention.sink_attention_reference`)
    rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> rotated q
        (contract: `inference.kernels.rope_cache.rope_and_write_kv_reference`)

"reference" is pure torch and always available (the CPU path). "triton" needs CUDA and Triton.
flashinfer was not wired in (see BENCHMARKS.md, "Attention kernels"), so asking for it is an
error rather than a silent substitute.
"""

from __future__ import annotations

import importlib.util

import torch

from .attention import sink_attention_reference
from .kernels.rope_cache import rope_and_write_kv_reference

BACKENDS = ("reference", "triton")


class ReferenceAttentionBackend:
    """Pure torch, float32 math: exact but slow; used on CPU and as the tests' yardstick."""

    name = "reference"

    @staticmethod
    def attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window):
        return sink_attention_reference(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window)

    @staticmethod
    def rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
        return rope_and_write_kv_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


class TritonAttentionBackend:
    """Triton kernels over the paged cache (`inference/kernels/attention_triton.py`, `rope_cache.py`)."""

    name = "triton"

    def __init__(self) -> None:
        from .kernels import attention_triton, rope_cache

        self._attention = attention_triton.paged_sink_attention
        self._rope_and_write_kv = rope_cache.rope_and_write_kv_triton

    def attention(self, q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window):
        return self._attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window)

    def rope_and_write_kv(self, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
        return self._rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


def triton_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def select_attention_backend(device, prefer: str | None = None):
    """The attention backend for `device`: `prefer` if given (error if it cannot run there),
    otherwise the fastest available one (Triton on CUDA, the reference elsewhere)."""
    device = torch.device(device)
    if prefer is not None and prefer not in BACKENDS:
        raise ValueError(f"unknown attention backend {prefer!r}; choose from {', '.join(BACKENDS)}")
    if prefer == "reference":
        return ReferenceAttentionBackend()
    if triton_available(device):
        return TritonAttentionBackend()
    if prefer == "triton":
        raise RuntimeError(f"the triton attention backend needs a CUDA device with triton installed, not {device}")
    return ReferenceAttentionBackend()
