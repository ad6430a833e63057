"""Which attention implementation the model runs: chosen once per model, by device.

Every backend has the same three methods:
    attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window) -> [T, Hq, D]
        (contract: `inference.ops.attention.reference.sink_attention_reference`)
    rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> rotated q
        (contract: `inference.ops.attention.rope_cache.rope_and_write_kv_reference`)
    rope_kv_attention(q, k, v, cos_sin, k_cache, v_cache, meta, block_table, slot_mapping, sinks,
                      sm_scale, window) -> [T, Hq, D]
        the two above in order, for the model's layers (`AttentionBackend`); the Triton backend
        runs a decode step as one kernel

"reference" is pure torch and always available (the CPU path). "triton" needs CUDA and Triton.
"flashinfer" (`inference/ops/attention/flashinfer.py`, needs the optional flashinfer-python) runs
flashinfer's kernels for the steps where they measured faster and the Triton kernels for the rest
(see `FlashInferAttentionBackend`); on CUDA it is the default wherever flashinfer is installed.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from inference.ops.attention.reference import sink_attention_reference
from inference.ops.attention.rope_cache import rope_and_write_kv_reference

log = logging.getLogger(__name__)

BACKENDS = ("reference", "triton", "flashinfer")
HEAD_DIMS = (64, 128, 256)  # the head sizes flashinfer's FA3 kernels are built for (gpt-oss: 64)


class AttentionBackend:
    """What every backend shares: a layer's RoPE + K/V cache write, then attention."""

    def rope_kv_attention(
        self, q, k, v, cos_sin, k_cache, v_cache, meta, block_table, slot_mapping, sinks, sm_scale, window
    ):
        """q [T, Hq, D], k and v [T, Hkv, D] as projected (not rotated, not in the cache yet)
        -> attention output [T, Hq, D]; rotated k and v are left at `slot_mapping`'s slots."""
        q = self.rope_and_write_kv(q, k, v, meta.positions, cos_sin, k_cache, v_cache, slot_mapping)
        return self.attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window)


class ReferenceAttentionBackend(AttentionBackend):
    """Pure torch, float32 math: exact but slow; used on CPU and as the tests' yardstick."""

    name = "reference"

    @staticmethod
    def attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window):
        return sink_attention_reference(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window)

    @staticmethod
    def rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
        return rope_and_write_kv_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels over the paged cache (`inference/ops/attention/triton.py`, `rope_cache.py`).
    Decode steps run RoPE, the cache write and attention as one kernel (one launch a layer
    fewer: 24 a step on gpt-oss)."""

    name = "triton"

    def __init__(self) -> None:
        from inference.ops.attention import rope_cache
        from inference.ops.attention import triton as attention_triton

        self._attention = attention_triton.paged_sink_attention
        self._rope_and_write_kv = rope_cache.rope_and_write_kv_triton
        self._decode_with_new_kv = attention_triton.decode_attention_with_new_kv
        self._is_pure_decode = attention_triton.is_pure_decode

    def attention(self, q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window):
        return self._attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window)

    def rope_and_write_kv(self, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
        return self._rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)

    def folds_rope_into_decode(self, q, meta, window) -> bool:
        return self._is_pure_decode(q.shape[0], meta)

    def warmup(self, num_qo_heads, num_kv_heads, head_dim, page_size, windows, dtype, kv_dtype=None) -> None:
        """Compile the decode kernel's variants for mixed steps now, not mid-request (on a CUDA
        GPU; the interpreter has nothing to compile). kv_dtype: the cache's (None: dtype)."""
        from inference.ops.attention import triton as attention_triton

        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            attention_triton.warm_up_mixed_decode(
                num_qo_heads, num_kv_heads, head_dim, page_size, windows, dtype, device, kv_dtype
            )

    def rope_kv_attention(
        self, q, k, v, cos_sin, k_cache, v_cache, meta, block_table, slot_mapping, sinks, sm_scale, window
    ):
        if self.folds_rope_into_decode(q, meta, window):
            return self._decode_with_new_kv(
                q, k, v, cos_sin, k_cache, v_cache, meta, block_table, slot_mapping, sinks, sm_scale, window
            )
        return super().rope_kv_attention(
            q, k, v, cos_sin, k_cache, v_cache, meta, block_table, slot_mapping, sinks, sm_scale, window
        )


class FlashInferAttentionBackend(TritonAttentionBackend):
    """flashinfer's paged sink attention where it is faster, the Triton kernels elsewhere.

    The split was measured on an H200 (docs/benchmark-log.md, "Which backend runs where"):
      * full-attention layers of a step with at least `FLASHINFER_MIN_TOKENS` new tokens: flashinfer
        (FA3 on Hopper): its kernel is 1.09x (2k tokens) to 1.23x (8k) faster than Triton's, but
        planning a step costs ~1 ms of host time, so whole-model prefill gains only from 8k tokens
        (+2% at 8k, +4% at 16k in single runs, within run-to-run noise; equal at 2k and 4k);
      * decode steps: Triton. They replay CUDA graphs, which flashinfer's per-step host planning
        (0.5 to 4 ms) cannot join; FA2's decode is at most 1.2x faster at long contexts and FA3's
        (a prefill kernel) 10x slower;
      * sliding-window layers: Triton, 1.5-2x faster than either flashinfer kernel;
      * anything captured into a CUDA graph, float32 queries (flashinfer has no float32
        kernels), head sizes outside `HEAD_DIMS` (its FA3 kernels do not build for them) and
        fp8 caches (`EngineConfig.kv_cache_dtype`; not measured there): Triton.
    RoPE + KV write is Triton's in every case (folded into Triton's decode kernel at decode).
    """

    name = "flashinfer"
    FLASHINFER_MIN_TOKENS = 8192

    def __init__(self, device: torch.device, kernel: str | None = None) -> None:
        from inference.ops.attention.flashinfer import FlashInferAttention

        super().__init__()
        self.flashinfer = FlashInferAttention(device, kernel)
        self.enabled = True  # False once its kernels failed to build: Triton serves everything

    def runs_flashinfer(self, q: torch.Tensor, meta, window: int | None) -> bool:
        return (
            self.enabled
            and window is None
            and q.shape[0] >= self.FLASHINFER_MIN_TOKENS
            and q.shape[-1] in HEAD_DIMS
            and q.dtype in (torch.bfloat16, torch.float16)
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
        )

    def attention(self, q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window):
        if k_cache.dtype == q.dtype and self.runs_flashinfer(q, meta, window):
            return self.flashinfer.attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window)
        return super().attention(q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window)

    def folds_rope_into_decode(self, q, meta, window) -> bool:
        return super().folds_rope_into_decode(q, meta, window) and not self.runs_flashinfer(q, meta, window)

    def warmup(self, num_qo_heads, num_kv_heads, head_dim, page_size, windows, dtype, kv_dtype=None) -> None:
        """Compile (first start on a machine) or load the kernels this split uses: full layers'
        flashinfer's, the Triton kernels' mixed-step variants. A flashinfer build that fails
        leaves Triton serving every step, with a warning."""
        super().warmup(num_qo_heads, num_kv_heads, head_dim, page_size, windows, dtype, kv_dtype)
        if kv_dtype not in (None, dtype):  # an fp8 cache: Triton serves every step (`attention`)
            return
        if dtype not in (torch.bfloat16, torch.float16) or None not in windows or head_dim not in HEAD_DIMS:
            return
        try:
            self.flashinfer.warmup(num_qo_heads, num_kv_heads, head_dim, page_size, (None,), dtype)
        except Exception:
            log.warning(
                "flashinfer's attention kernels could not be built; the Triton kernels serve every step", exc_info=True
            )
            self.enabled = False


def flashinfer_usable(device: torch.device) -> bool:
    """flashinfer is installed and the GPU is a Hopper (SM 9.0): its FA3 prefill kernel, Hopper-only,
    is what measured faster than Triton's; FA2 (what other GPUs get) was slower at prefill."""
    from inference.ops.attention.flashinfer import flashinfer_available

    return (
        triton_available(device) and flashinfer_available(device) and torch.cuda.get_device_capability(device)[0] == 9
    )


def triton_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def select_attention_backend(device, prefer: str | None = None):
    """The attention backend for `device`: `prefer` if given (error if it cannot run there),
    otherwise the fastest available one (flashinfer + Triton, else Triton, on CUDA; the
    reference elsewhere)."""
    device = torch.device(device)
    if prefer is not None and prefer not in BACKENDS:
        raise ValueError(f"unknown attention backend {prefer!r}; choose from {', '.join(BACKENDS)}")
    if prefer == "reference":
        return ReferenceAttentionBackend()
    if prefer in (None, "flashinfer") and flashinfer_usable(device):
        try:
            return FlashInferAttentionBackend(device)
        except Exception:  # installed but not importable here (another torch, a broken build...)
            if prefer == "flashinfer":
                raise
            log.warning(
                "flashinfer is installed but could not be loaded; the Triton kernels serve attention", exc_info=True
            )
    if prefer == "flashinfer":
        raise RuntimeError(
            f"the flashinfer attention backend needs a Hopper GPU (SM 9.0) with triton and "
            f"flashinfer-python installed (pip install 'oss-agent[gpu]'), not {device}"
        )
    if triton_available(device):
        return TritonAttentionBackend()
    if prefer == "triton":
        raise RuntimeError(f"the triton attention backend needs a CUDA device with triton installed, not {device}")
    return ReferenceAttentionBackend()
