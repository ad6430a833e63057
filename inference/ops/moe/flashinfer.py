"""flashinfer's SM90 mixed-input CUTLASS fused MoE (MXFP4 weights x bf16 activations) as a MoE
backend: the same `prepare` / `forward` interface as `inference.ops.moe.backend`'s backends, the math
of `inference.ops.moe.reference.moe_reference`.

flashinfer is optional: this module imports without it, and `flashinfer_supports(device)` says
whether the backend can run (flashinfer importable, an SM90 GPU). flashinfer compiles the kernels
on first use (JIT, `fused_moe_90`: ~248 sources, ~1300 CUTLASS kernels); `python3 -m
inference.ops.moe.flashinfer build` runs that build alone and shows its progress.

Layout (`prepare`, once per layer; H hidden, I intermediate, E experts; Hp, Ip = H, I rounded up
to 128, because the kernel folds scales per 64-row x 128-column block and its smallest K tile is
128; gpt-oss's 2880 becomes 2944, zero weights and biases in the padding):
    w1  uint8 [E, 2Ip, Hp/2]   gate_up, two e2m1 codes a byte (low nibble first), byte-interleaved
                               by `interleave_moe_weights_for_sm90_mixed_gemm(., "fp4")`.
                               Rows: [up (Ip) ; gate (Ip)]: flashinfer's gated activation reads
                               the gate from the second half (TRT-LLM's "w3, w1" order), while
                               the checkpoint interleaves gate, up, gate, up ...
    s1  uint8 [E, 2Ip/64, Hp/128, 16, 16]  E8M0 block scales (one per 32 values) folded by
                               `interleave_moe_scales_for_sm90_mixed_gemm`; passed as int32 views
    b1  bf16 [E, 2Ip]          gate_up bias, same row order (flashinfer wants biases in the
                               output dtype; bf16 rounding of the bias is ~0.4% of the bias)
    w2  uint8 [E, Hp, Ip/2], s2 uint8 [E, Hp/64, Ip/128, 16, 16], b2 bf16 [E, Hp]   down
The activation is flashinfer's SwigluBias: gate = min(gate, limit), up = clamp(up, -limit, limit),
out = gate * sigmoid(alpha * gate) * (up + beta), which is gpt-oss's with alpha = 1.702, beta = 1.

`forward(x [T, H] bf16)`: router logits (flashinfer's `tinygemm_bf16` for small batches on SM90,
else torch), top-k and softmax over the k in torch, then one `cutlass_fused_moe` call (expand,
grouped GEMM1, bias + SwiGLU, grouped GEMM2, routing-weighted combine). Padded hidden sizes cost
a pad of x and a copy of the output. Nothing reads a GPU value on the host and the workspace is
reused, so a step can be captured in a CUDA graph. Without tuning flashinfer runs its first
tactic (a 64x16x128 tile); `FlashInferMoEBackend.autotune` profiles tactics for given batches.

Status (2026-11-24, H200): measured (docs/benchmark-log.md, "flashinfer's fused MoE, measured"). With
its fastest built tactics it is 3x slower than the Triton kernels at batch 1, 1.18x at 64 tokens
and 1.07x at 2048 (20b); only 120b at 2048 tokens ties (1% ahead, within noise). Its default
tactic is 2.3-2.9x slower at 2048 tokens, and its autotuner needs more JIT modules. So
this backend stays opt-in (`select_moe_backend(dev, "flashinfer")`). Its full JIT build takes
longer than is practical on a benchmark machine (tens of minutes); `experiments/flashinfer_moe_subset.py` builds the bf16
x MXFP4 part alone, on any machine with nvcc. `tests/inference/ops/test_moe_flashinfer.py` checks it
against the reference (it passes; on a mismatch it prints which convention would fit).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inference.ops.moe.reference import MoEWeights, moe_reference
from inference.ops.mxfp4 import BLOCK_SIZE

SWIGLU_ALPHA = 1.702
SWIGLU_BETA = 1.0  # gpt-oss multiplies by (up + 1)
K_ALIGN = 128  # hidden and intermediate sizes are padded to this (see the module docstring)
EXPERT_CHUNK = 8  # experts converted at a time in `prepare`, to bound temporary memory
PAD_SCALE = 127  # E8M0 byte of 1.0, for the padding's (zero) weights


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_supports(device) -> bool:
    """flashinfer is importable and `device` is an SM90 (Hopper) GPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not flashinfer_available():
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class FlashInferMoEWeights:
    """One layer's MoE weights in flashinfer's SM90 W4A16 layout (see the module docstring)."""

    router_weight: torch.Tensor  # [E, H] bf16
    router_bias: torch.Tensor  # [E] bf16
    w1: torch.Tensor  # [E, 2Ip, Hp/2] uint8, rows [up ; gate]
    s1: torch.Tensor  # [E, 2Ip/64, Hp/128, 16, 16] uint8
    b1: torch.Tensor  # [E, 2Ip] bf16
    w2: torch.Tensor  # [E, Hp, Ip/2] uint8
    s2: torch.Tensor  # [E, Hp/64, Ip/128, 16, 16] uint8
    b2: torch.Tensor  # [E, Hp] bf16
    hidden_size: int  # H, before padding
    intermediate_size: int  # I, before padding
    alpha: torch.Tensor | None = None  # [E] float32, SWIGLU_ALPHA
    beta: torch.Tensor | None = None  # [E] float32, SWIGLU_BETA
    limits: dict = field(default_factory=dict)  # swiglu limit -> [E] float32 tensor

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def padded_hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def padded_intermediate_size(self) -> int:
        return self.w1.shape[1] // 2

    def limit_tensor(self, limit: float) -> torch.Tensor:
        """The per-expert limit flashinfer reads, made once per value (outside any graph
        capture when the first call is a warm-up, as the engine's is)."""
        key = float(limit)
        if key not in self.limits:
            self.limits[key] = torch.full((self.num_experts,), key, dtype=torch.float32, device=self.w1.device)
        return self.limits[key]


def _padded(t: torch.Tensor, shape: tuple[int, ...], fill: int) -> torch.Tensor:
    """t placed at the start of a new tensor of `shape` filled with `fill` (t itself if it fits)."""
    if tuple(t.shape) == shape:
        return t.contiguous()
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _pack_experts(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor] | None,
    n_pad: int,
    k_pad: int,
    interleave_weights: bool,
    interleave_scales: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint MXFP4 (blocks [E, N, K/32, 16], scales [E, N, K/32]) -> flashinfer's (w [E, Np, Kp/2],
    s [E, Np/64, Kp/128, 16, 16]). `rows`: None keeps the row order; else the row indices of the
    first and second halves (up, gate), each half padded to Np/2 on its own. A few experts at a time."""
    from flashinfer.fused_moe import (
        interleave_moe_scales_for_sm90_mixed_gemm,
        interleave_moe_weights_for_sm90_mixed_gemm,
    )

    e_count, n, groups, _ = blocks.shape
    w_out = torch.empty(e_count, n_pad, k_pad // 2, dtype=torch.uint8, device=blocks.device)
    s_out = None
    for e0 in range(0, e_count, EXPERT_CHUNK):
        e1 = min(e0 + EXPERT_CHUNK, e_count)
        b = blocks[e0:e1].reshape(e1 - e0, n, groups * BLOCK_SIZE // 2)  # packed codes in value order
        s = scales[e0:e1]
        if rows is None:
            w = _padded(b, (e1 - e0, n_pad, k_pad // 2), 0)
            sc = _padded(s, (e1 - e0, n_pad, k_pad // BLOCK_SIZE), PAD_SCALE)
        else:  # two halves, each padded to n_pad / 2 rows
            half = n_pad // 2
            w = torch.cat([_padded(b[:, r], (e1 - e0, half, k_pad // 2), 0) for r in rows], dim=1)
            sc = torch.cat([_padded(s[:, r], (e1 - e0, half, k_pad // BLOCK_SIZE), PAD_SCALE) for r in rows], dim=1)
        w_out[e0:e1] = interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4") if interleave_weights else w
        sc = (
            interleave_moe_scales_for_sm90_mixed_gemm(sc)
            if interleave_scales
            else sc.reshape(e1 - e0, n_pad // 64, k_pad // K_ALIGN, 16, 16)
        )  # raw order, same shape: only for diagnosis
        if s_out is None:
            s_out = torch.empty((e_count, *sc.shape[1:]), dtype=torch.uint8, device=blocks.device)
        s_out[e0:e1] = sc
    return w_out, s_out


def prepare_flashinfer_weights(
    weights: MoEWeights, *, interleave_weights: bool = True, interleave_scales: bool = True, swap_gate_up: bool = False
) -> FlashInferMoEWeights:
    """One layer's checkpoint MXFP4 weights -> flashinfer's layout (once, at load time).

    The keyword flags change the layout away from what flashinfer documents; they exist so a
    mismatch can be diagnosed in one GPU run (tests/inference/ops/test_moe_flashinfer.py)."""
    ex = weights.experts
    if not ex.is_mxfp4:
        raise ValueError("flashinfer's mixed-input MoE needs MXFP4 experts")
    e_count, hidden = weights.router_weight.shape
    two_i = ex.gate_up_bias.shape[1]
    inter = two_i // 2
    if hidden % BLOCK_SIZE or inter % BLOCK_SIZE:
        raise ValueError(f"hidden {hidden} and intermediate {inter} sizes must be multiples of {BLOCK_SIZE}")
    expect = {
        "gate_up_blocks": (ex.gate_up_blocks, (e_count, two_i, hidden // BLOCK_SIZE, 16)),
        "down_blocks": (ex.down_blocks, (e_count, hidden, inter // BLOCK_SIZE, 16)),
    }
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    hp, ip = round_up(hidden, K_ALIGN), round_up(inter, K_ALIGN)
    dev = ex.gate_up_blocks.device
    gates, ups = torch.arange(0, two_i, 2, device=dev), torch.arange(1, two_i, 2, device=dev)
    halves = (gates, ups) if swap_gate_up else (ups, gates)  # flashinfer: [up ; gate]
    layout = dict(interleave_weights=interleave_weights, interleave_scales=interleave_scales)
    w1, s1 = _pack_experts(ex.gate_up_blocks, ex.gate_up_scales, halves, 2 * ip, hp, **layout)
    w2, s2 = _pack_experts(ex.down_blocks, ex.down_scales, None, hp, ip, **layout)
    bias = ex.gate_up_bias.to(dev)
    b1 = torch.cat([_padded(bias[:, h], (e_count, ip), 0) for h in halves], dim=1).to(torch.bfloat16)
    b2 = _padded(ex.down_bias.to(dev), (e_count, hp), 0).to(torch.bfloat16)
    return FlashInferMoEWeights(
        router_weight=weights.router_weight.to(dev, torch.bfloat16).contiguous(),
        router_bias=weights.router_bias.to(dev, torch.bfloat16).contiguous(),
        w1=w1,
        s1=s1,
        b1=b1.contiguous(),
        w2=w2,
        s2=s2,
        b2=b2.contiguous(),
        hidden_size=hidden,
        intermediate_size=inter,
        alpha=torch.full((e_count,), SWIGLU_ALPHA, dtype=torch.float32, device=dev),
        beta=torch.full((e_count,), SWIGLU_BETA, dtype=torch.float32, device=dev),
    )


class FlashInferMoEBackend:
    """MXFP4 experts through flashinfer's SM90 CUTLASS fused MoE. Dense (bf16) checkpoints fall
    back to the reference math, as the Triton backend's do.

    tinygemm_max_tokens: batches up to this size compute router logits with `tinygemm_bf16` (a
    latency-tuned GEMV for a few rows); larger ones, or 0 here, use torch's GEMM."""

    name = "flashinfer"
    float32_output = False  # the CUTLASS kernel writes bf16

    def __init__(self, tinygemm_max_tokens: int = 64) -> None:
        import flashinfer.fused_moe as fused_moe  # ImportError here: flashinfer is not installed

        self._fused_moe = fused_moe
        self.tinygemm_max_tokens = tinygemm_max_tokens
        self._tinygemm = None
        if tinygemm_max_tokens > 0:
            try:
                from flashinfer.gemm import tinygemm_bf16

                self._tinygemm = tinygemm_bf16
            except ImportError:  # an older flashinfer: torch's GEMM for every batch
                pass
        self._workspace: torch.Tensor | None = None
        self._workspace_key = None
        # [gemm1, gemm2] tactic indices in flashinfer's combined list (-1: its default), for
        # benchmarks that time tactics one by one; None leaves the choice to flashinfer.
        self.profile_ids: list[int] | None = None

    def prepare(self, weights: MoEWeights):
        experts = weights.experts
        if weights.expert_offset or experts.num_experts != weights.router_weight.shape[0]:
            raise ValueError(
                "the flashinfer MoE backend holds every expert: for expert parallelism "
                "(moe_parallel='expert') use the triton backend"
            )
        if not experts.is_mxfp4:
            return weights
        prepared = prepare_flashinfer_weights(weights)
        # flashinfer's copy replaces the checkpoint's: drop ours so the GPU holds one.
        experts.gate_up_blocks = experts.gate_up_scales = experts.down_blocks = experts.down_scales = None
        return prepared

    def route(self, x: torch.Tensor, prepared: FlashInferMoEWeights, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] bf16 -> (expert ids [T, k] int32, routing weights [T, k] float32): the top k
        of the bf16 router logits, softmax over those k."""
        e_count = prepared.num_experts
        if (
            self._tinygemm is not None
            and x.shape[0] <= self.tinygemm_max_tokens
            and e_count % 16 == 0
            and x.shape[1] % 64 == 0
        ):
            logits = torch.empty(x.shape[0], e_count, dtype=torch.bfloat16, device=x.device)
            self._tinygemm(x, prepared.router_weight, logits, bias=prepared.router_bias)
        else:
            logits = F.linear(x, prepared.router_weight, prepared.router_bias)
        top_values, top_ids = torch.topk(logits, top_k, dim=-1)
        return top_ids.to(torch.int32), torch.softmax(top_values.float(), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        prepared,
        top_k: int,
        swiglu_limit: float,
        out_dtype: torch.dtype | None = None,
        valid_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # valid_tokens is not used: padding rows go through the experts like real ones.
        if isinstance(prepared, MoEWeights):
            return moe_reference(x, prepared, top_k, swiglu_limit, out_dtype=out_dtype)
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != prepared.hidden_size:
            raise ValueError(
                f"flashinfer's MoE takes x [T, {prepared.hidden_size}] bf16, got {tuple(x.shape)} {x.dtype}"
            )
        if x.shape[0] == 0:
            return x.new_empty(0, prepared.hidden_size, dtype=out_dtype or x.dtype)
        x = x.contiguous()
        ids, gates = self.route(x, prepared, top_k)
        out = self.experts(x, prepared, ids, gates, swiglu_limit)  # bf16 from the kernel
        return out.to(out_dtype or out.dtype)  # no copy when the dtype already matches

    def experts(
        self,
        x: torch.Tensor,
        prepared: FlashInferMoEWeights,
        ids: torch.Tensor,
        gates: torch.Tensor,
        swiglu_limit: float,
        swiglu_beta: float | None = None,
    ) -> torch.Tensor:
        """The experts for given routing: x [T, H] bf16, ids [T, k] int32, gates [T, k] float32
        -> [T, H] bf16. (`swiglu_beta` overrides gpt-oss's 1.0, for diagnosis only.)"""
        t, hidden = x.shape
        hp = prepared.padded_hidden_size
        x_in = F.pad(x, (0, hp - hidden)) if hp != hidden else x
        out = torch.empty(t, hp, dtype=torch.bfloat16, device=x.device)
        beta = prepared.beta if swiglu_beta is None else torch.full_like(prepared.beta, swiglu_beta)
        self._fused_moe.cutlass_fused_moe(
            x_in,
            ids.to(torch.int32).contiguous(),
            gates.float().contiguous(),
            prepared.w1,
            prepared.w2,
            torch.bfloat16,
            quant_scales=[prepared.s1.view(torch.int32), prepared.s2.view(torch.int32)],
            fc1_expert_biases=prepared.b1,
            fc2_expert_biases=prepared.b2,
            swiglu_alpha=prepared.alpha,
            swiglu_beta=beta,
            swiglu_limit=prepared.limit_tensor(swiglu_limit),
            use_w4_group_scaling=True,
            output=out,
            workspace_buffer=self._workspace_for(t, ids.shape[1], prepared, x.device),
            **({} if self.profile_ids is None else {"profile_ids": list(self.profile_ids)}),
        )
        return out[:, :hidden].contiguous() if hp != hidden else out

    def _workspace_for(self, tokens: int, top_k: int, prepared: FlashInferMoEWeights, device) -> torch.Tensor:
        """One scratch buffer for every layer (they run one after another on one stream), grown
        to the next power of two of tokens when a batch needs more; reused inside CUDA graphs."""
        shape = (prepared.padded_hidden_size, prepared.padded_intermediate_size, prepared.num_experts, top_k)
        capacity = 1 << max(tokens - 1, 0).bit_length()
        if self._workspace_key is not None and self._workspace_key[0] == shape and self._workspace_key[1] >= tokens:
            return self._workspace
        size = self._fused_moe.cutlass_fused_moe_workspace_size(
            capacity,
            shape[0],
            shape[1],
            shape[2],
            top_k,
            x_dtype=torch.bfloat16,
            weight_dtype=torch.uint8,
            activation_type=self._fused_moe.ActivationType.SwigluBias,
            use_w4_group_scaling=True,
            device=device,
        )
        self._workspace = torch.empty(size, dtype=torch.uint8, device=device)
        self._workspace_key = (shape, capacity)
        return self._workspace

    def autotune(self, prepared: FlashInferMoEWeights, top_k: int, swiglu_limit: float, batches) -> None:
        """Profile flashinfer's GEMM tactics for these batch sizes (random inputs; minutes). Later
        calls with those sizes, graph captures included, use the fastest tactics found."""
        from flashinfer.autotuner import autotune

        batches = sorted(set(int(b) for b in batches))
        with autotune(True, tuning_buckets=tuple(batches)):
            for t in batches:
                x = torch.randn(t, prepared.hidden_size, device=prepared.w1.device).to(torch.bfloat16)
                self.forward(x, prepared, top_k, swiglu_limit)
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- JIT build


def build_module(report_every: float = 30.0) -> None:
    """Compile (or load) flashinfer's SM90 fused-MoE module, printing progress: ninja's object
    files so far out of the sources. An interrupted build resumes where it stopped while
    FLASHINFER_WORKSPACE_BASE (default: $HOME) keeps its cache."""
    import threading

    from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    spec = gen_cutlass_fused_moe_sm90_module()
    total = len(spec.sources)
    print(
        f"fused_moe_90: {total} sources ({sum(s.suffix == '.cu' for s in spec.sources)} .cu), "
        f"build dir {spec.build_dir}",
        flush=True,
    )
    done = threading.Event()
    start = time.monotonic()

    def progress() -> None:
        while not done.wait(report_every):
            built = sum(1 for _ in spec.build_dir.glob("*.o")) if spec.build_dir.exists() else 0
            print(f"[{time.monotonic() - start:6.0f}s] {built}/{total} objects", flush=True)

    threading.Thread(target=progress, daemon=True).start()
    try:
        get_cutlass_fused_moe_module("90")
    finally:
        done.set()
    print(f"fused_moe_90 loaded after {time.monotonic() - start:.0f}s", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python3 -m inference.ops.moe.flashinfer build")
    build_module()
