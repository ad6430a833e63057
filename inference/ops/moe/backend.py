"""Which MoE implementation the model runs: chosen once per model, by device.

Every backend has the same two methods:
    prepare(weights: MoEWeights) -> prepared
        once per layer at load time: converts the weights into the backend's layout. It may
        release the original expert tensors (the Triton backend does, so a model does not hold
        two copies); use only `prepared` afterwards.
    forward(x [T, H], prepared, top_k, swiglu_limit, out_dtype=None, valid_tokens=None)
        -> [T, H] in out_dtype: the MoE block (contract: `inference.ops.moe.reference.moe_reference`);
        out_dtype defaults to x's. valid_tokens: None, or int32 [1] on x's device, the number
        of real rows of a padded step (a CUDA graph's); the rows past it are padding whose
        output nobody reads. A backend may skip them (the Triton kernels route them nowhere,
        so a padded row costs no expert reads) or compute them anyway.
A backend may also have `add_norm_forward(x, delta, norm_weight, eps, prepared, top_k,
swiglu_limit, out_dtype, valid_tokens)` -> (x + delta, forward(rmsnorm(x + delta))) or None,
which folds the residual add and norm before the block into its own kernels (the Triton
backend's router).
and one attribute, `float32_output`: whether the backend's own result is float32. The model
then asks for float32 (`model_output_dtype`), which the residual add takes as it is: for the
Triton kernels that saves a cast kernel a layer (one launch at batch 1).

"reference" is pure torch over the packed weights, dequantising only the experts a batch uses;
always available, the CPU path. "triton" (`inference/ops/moe/triton.py`) keeps experts in
MXFP4 on the GPU and never synchronises with the host, so decode steps can be captured in CUDA
graphs. "flashinfer" (`inference/ops/moe/flashinfer.py`) runs flashinfer's SM90 mixed-input CUTLASS
fused MoE on the same MXFP4 weights; it is optional (flashinfer need not be installed), chosen
only when asked for, and asking for it where it cannot run (no flashinfer, not an SM90 GPU) is an
error rather than a silent substitute.
"""

from __future__ import annotations

import importlib.util

import torch

from inference.ops.moe.reference import MoEWeights, moe_reference

BACKENDS = ("reference", "triton", "flashinfer")


class ReferenceMoEBackend:
    """Float32 math over the checkpoint's own layout: exact, slow; the tests' yardstick."""

    name = "reference"
    float32_output = True

    @staticmethod
    def prepare(weights: MoEWeights) -> MoEWeights:
        return weights

    @staticmethod
    def forward(
        x: torch.Tensor,
        prepared: MoEWeights,
        top_k: int,
        swiglu_limit: float,
        out_dtype: torch.dtype | None = None,
        valid_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return moe_reference(x, prepared, top_k, swiglu_limit, out_dtype=out_dtype)  # padding rows computed too


class TritonMoEBackend:
    """MXFP4 experts, Triton kernels. Checkpoints with dense (bf16) experts fall back to the
    reference math, which is correct but slow and not capturable in a CUDA graph."""

    name = "triton"
    float32_output = True  # the kernels sum into float32 rows

    def __init__(self, config=None) -> None:
        from inference.ops.moe import triton as moe_triton

        self._kernels = moe_triton
        self.config = config or moe_triton.DEFAULT_CONFIG

    def prepare(self, weights: MoEWeights):
        experts = weights.experts
        if not experts.is_mxfp4:
            return weights
        prepared = self._kernels.prepare_moe_weights(weights)
        # The kernels' copy replaces the checkpoint's: drop ours so the GPU holds one.
        experts.gate_up_blocks = experts.gate_up_scales = experts.down_blocks = experts.down_scales = None
        return prepared

    def forward(
        self,
        x: torch.Tensor,
        prepared,
        top_k: int,
        swiglu_limit: float,
        out_dtype: torch.dtype | None = None,
        valid_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(prepared, MoEWeights):
            return moe_reference(x, prepared, top_k, swiglu_limit, out_dtype=out_dtype)
        return self._kernels.fused_moe(
            x, prepared, top_k, swiglu_limit, self.config, out_dtype=out_dtype, valid_tokens=valid_tokens
        )

    def add_norm_forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        prepared,
        top_k: int,
        swiglu_limit: float,
        out_dtype: torch.dtype | None = None,
        valid_tokens: torch.Tensor | None = None,
    ):
        """(x + delta, forward(rmsnorm(x + delta) * norm_weight)), the add and norm fused into the
        kernels' router at decode sizes; None where the kernels do not take these weights."""
        if isinstance(prepared, MoEWeights):
            return None
        return self._kernels.fused_add_norm_moe(
            x,
            delta,
            norm_weight,
            eps,
            prepared,
            top_k,
            swiglu_limit,
            self.config,
            out_dtype=out_dtype,
            valid_tokens=valid_tokens,
        )


def model_output_dtype(backend) -> torch.dtype | None:
    """The out_dtype a single-device model asks `backend` for: float32 where that is its own
    result (no cast), else None (x's dtype)."""
    return torch.float32 if backend.float32_output else None


def triton_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def select_moe_backend(device, prefer: str | None = None):
    """The MoE backend for `device`: `prefer` if given (error if it cannot run there),
    otherwise Triton on CUDA and the reference elsewhere (flashinfer only when asked for)."""
    device = torch.device(device)
    if prefer is not None and prefer not in BACKENDS:
        raise ValueError(f"unknown MoE backend {prefer!r}; choose from {', '.join(BACKENDS)}")
    if prefer == "reference":
        return ReferenceMoEBackend()
    if prefer == "flashinfer":
        from inference.ops.moe.flashinfer import FlashInferMoEBackend, flashinfer_available, flashinfer_supports

        if not flashinfer_supports(device):
            why = "flashinfer is not installed" if not flashinfer_available() else f"{device} is not an SM90 GPU"
            raise RuntimeError(f"the flashinfer MoE backend needs flashinfer and an SM90 (Hopper) GPU: {why}")
        return FlashInferMoEBackend()
    if triton_available(device):
        return TritonMoEBackend()
    if prefer == "triton":
        raise RuntimeError(f"the triton MoE backend needs a CUDA device with triton installed, not {device}")
    return ReferenceMoEBackend()
