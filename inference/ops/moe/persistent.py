"""The batch-1 MoE block after its router as one persistent CUDA kernel (`persistent_kernel.cu`).

At one token a 20b MoE layer reads 53 MB of expert weights. As three launches (router, gate_up
GEMV, down GEMV) it took 23.3 us on an H200, 53% of copy bandwidth, and the launch structure alone
bounded it near 68% (docs/benchmark-log.md, "What a cheaper MXFP4 decode could buy at batch 1").
This kernel replaces the two GEMV launches: one CTA per SM streams whole row groups of expert
weights through shared memory with bulk copies while its consumer warps compute, and a grid-wide
barrier separates gate_up from down, with down's weights already streaming across it.

The router kernel (`triton.decode_router`) still runs first; this kernel launches as its
programmatic dependent. It reads the same weight layout as the Triton kernels and does the same
arithmetic. Where it cannot run (no NVRTC, a GPU before Hopper, other shapes), `fused_moe` keeps
the Triton GEMVs.

On an H200 it took 24.7 us a 20b layer against the GEMVs' 23.3, and the engine's batch-1 decode
was 3% slower with it, so it is opt-in (`OSS_AGENT_PERSISTENT_MOE=1`). Without its arithmetic
its structure alone takes 19.1 us, and the decode's integer instructions keep the arithmetic
longer than the bytes (docs/benchmark-log.md, "A persistent batch-1 MoE kernel").
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from inference.device import cuda_index
from inference.ops import nvrtc
from inference.ops.dependent_launch import uses_pdl
from inference.ops.multiprocessors import multiprocessors

SOURCE = Path(__file__).with_name("persistent_kernel.cu").read_text()
KERNEL = "moe_decode_persistent"
CONSUMER_WARPS = 16  # four groups of 4, taking units in turn
THREADS = (CONSUMER_WARPS + 1) * 32  # and the producer warp
MAX_STAGES = 8
MAX_EXPERTS = 128  # the kernel's top-k holds 4 logits a lane
MAX_UNITS_OF_A_KIND = 32  # gate_up, and down, units a CTA can take (a lane of one warp each)
TILE_BYTES = 144  # a 64-value tile of x or act in shared memory (the kernel's TILE_WORDS * 4)
# Extra compile definitions, for benchmarks: -DTIMELINE (each CTA writes %globaltimer stamps of its
# phases after the barrier counter, TIMELINE_SLOTS a CTA; `timeline`), -DLOAD_ONLY (the loads and
# barriers without the arithmetic: wrong results, the structure's own time).
EXTRA_DEFINES: tuple[str, ...] = ()
TIMELINE_SLOTS = 16
TIMELINE_EVENTS = {
    0: "start",
    1: "past griddepcontrol.wait",
    2: "top-k and unit list done",
    3: "first bulk copy issued",
    4: "first unit's bytes arrived",
    5: "own gate_up units done",
    6: "the CTA's gate_up units done",
    10: "first down copy issued",
    7: "grid barrier passed",
    8: "act in shared memory",
    9: "last bulk copy issued",
    11: "group 0 done",
    12: "group 1 done",
    13: "group 2 done",
    14: "group 3 done",
}
# Off by default: on an H200 it measured slower than the two Triton GEMVs (docs/benchmark-log.md,
# "A persistent batch-1 MoE kernel"); `OSS_AGENT_PERSISTENT_MOE=1` turns it on.
_enabled = os.environ.get("OSS_AGENT_PERSISTENT_MOE", "0") == "1"


@dataclass(frozen=True)
class StagePlan:
    """The kernel's shared memory: `stages` ring stages of `stage_bytes`, then the x / act tiles."""

    stages: int
    stage_bytes: int
    shared_bytes: int


def stage_plan(p1: int, p2: int, top_k: int, k_pad: int, i_pad: int, shared_limit: int) -> StagePlan | None:
    """As many stages (up to MAX_STAGES) as fit beside the activation tiles in shared_limit bytes
    (a CTA's opt-in maximum less the kernel's static shared memory); None if fewer than 2 fit.
    A stage holds one unit: a gate_up row group (16 rows x p1 pairs x 64 bytes, and a 4-byte
    scale word per row and pair), or a down one (8 rows x p2 pairs)."""
    stage_bytes = max(p1 * 16 * 68, p2 * 8 * 68)
    stage_bytes = -(-stage_bytes // 128) * 128
    tile_bytes = max(k_pad // 64, top_k * (i_pad // 64)) * TILE_BYTES
    stages = min(MAX_STAGES, (shared_limit - tile_bytes) // stage_bytes)
    if stages < 2:
        return None
    return StagePlan(stages, stage_bytes, stages * stage_bytes + tile_bytes)


def set_enabled(enabled: bool) -> None:
    """Use the kernel where it applies (benchmarks compare it with the Triton GEMVs)."""
    global _enabled
    _enabled = enabled


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0) and nvrtc.available()


def applies(x: torch.Tensor, num_experts: int, hidden: int, inter: int, top_k: int) -> bool:
    """Whether `fused_moe` runs the persistent kernel for x [T, H]: where it is `supported` and
    turned on (`OSS_AGENT_PERSISTENT_MOE=1`, or `set_enabled`)."""
    return _enabled and supported(x, num_experts, hidden, inter, top_k)


def supported(x: torch.Tensor, num_experts: int, hidden: int, inter: int, top_k: int) -> bool:
    """Whether the kernel can run x [T, H]: one token, on a Hopper or later GPU with NVRTC,
    gpt-oss-like shapes."""
    if x.device.type != "cuda" or x.shape[0] != 1:
        return False
    if num_experts > MAX_EXPERTS or top_k > 8 or hidden % 8 or inter % 8:
        return False
    units = top_k * (max(hidden, inter) // 8)
    if -(-units // multiprocessors(x.device)) > MAX_UNITS_OF_A_KIND:
        return False
    index = cuda_index(x.device)
    return _device_ok(index) and _plan(index, hidden, inter, top_k) is not None


@functools.lru_cache(maxsize=None)
def _plan(index: int, hidden: int, inter: int, top_k: int) -> StagePlan | None:
    """`stage_plan` for these shapes on GPU `index` (its opt-in shared memory less the kernel's
    static part and some slack): gate_up rows have ceil(H / 128) tile pairs, down rows ceil(I / 128)."""
    props = torch.cuda.get_device_properties(index)
    shared = (getattr(props, "shared_memory_per_block_optin", 0) or 232448) - 2048
    p1, p2 = -(-hidden // 128), -(-inter // 128)
    return stage_plan(p1, p2, top_k, 128 * p1, 128 * p2, shared)


def _kernel(device: torch.device, top_k: int, hidden: int, inter: int, p1: int, p2: int, plan: StagePlan):
    defines = (
        f"-DTOP_K={top_k}",
        f"-DHIDDEN={hidden}",
        f"-DINTER={inter}",
        f"-DP1={p1}",
        f"-DP2={p2}",
        f"-DSTAGES={plan.stages}",
        f"-DSTAGE_BYTES={plan.stage_bytes}",
        f"-DCONSUMER_WARPS={CONSUMER_WARPS}",
    )
    return nvrtc.load_kernel(SOURCE, KERNEL, device, defines + ("-lineinfo",) + EXTRA_DEFINES)


_barriers: dict[int, torch.Tensor] = {}


def _barrier(device: torch.device) -> torch.Tensor:
    """The grid barrier's arrival counter for `device` (int64, element 0), shared by every layer:
    launches on one stream run one after another, and each adds one grid's worth of arrivals.
    (Two streams running the kernel at once on one GPU would mix their arrivals: one model a
    device, as the engine runs.) After it, TIMELINE_SLOTS stamps a CTA for -DTIMELINE builds."""
    index = cuda_index(device)
    if index not in _barriers:
        _barriers[index] = torch.zeros(1 + TIMELINE_SLOTS * multiprocessors(device), dtype=torch.int64, device=device)
    return _barriers[index]


def timeline(device: torch.device) -> dict[str, tuple[float, float]]:
    """After a -DTIMELINE launch: each event's (median, max) over the CTAs, in µs after the first
    CTA's start."""
    stamps = _barrier(device)[1:].view(-1, TIMELINE_SLOTS).cpu()
    start = stamps[:, 0].min().item()
    out = {}
    for slot, name in TIMELINE_EVENTS.items():
        column = stamps[:, slot]
        column = column[column > 0]
        if column.numel():
            us = (column - start).double() / 1e3
            out[name] = (us.median().item(), us.max().item())
    return dict(sorted(out.items(), key=lambda item: item[1][0]))


def moe_after_router(
    x_half: torch.Tensor,
    inv_scale: torch.Tensor,
    logits: torch.Tensor,
    w,
    out32: torch.Tensor,
    valid_tokens: torch.Tensor | None,
    top_k: int,
    swiglu_limit: float,
    swiglu_alpha: float,
    act_scale: float,
) -> None:
    """gate_up, SwiGLU, down and the routing-weighted sum for one token, adding into out32 [1, H]
    (float32, zeroed by the router kernel). x_half [1, k_pad], inv_scale [1], logits [1, E]: the
    router kernel's outputs. w: `TritonMoEWeights`."""
    device = x_half.device
    hidden, inter = w.hidden_size, w.intermediate_size
    p1, p2 = w.w1.shape[2], w.w2.shape[2]  # the layout's tile pairs: those `_plan` counts
    i_pad = p2 * 128
    plan = _plan(cuda_index(device), hidden, inter, top_k)
    if plan is None:
        raise ValueError(f"the persistent MoE kernel does not fit shapes H={hidden}, I={inter}")
    kernel = _kernel(device, top_k, hidden, inter, p1, p2, plan)
    act = torch.empty(top_k, i_pad, dtype=torch.float16, device=device)
    pointer = lambda t: ctypes.c_void_p(t.data_ptr() if t is not None else None)  # noqa: E731
    args = [
        pointer(x_half),
        pointer(inv_scale),
        pointer(logits),
        pointer(w.w1),
        pointer(w.s1),
        pointer(w.b1),
        pointer(w.w2),
        pointer(w.s2),
        pointer(w.b2),
        pointer(act),
        pointer(out32),
        pointer(valid_tokens),
        pointer(_barrier(device)),
        ctypes.c_int(w.router_experts),
        ctypes.c_int(w.expert_offset),
        ctypes.c_int(w.num_experts),
        ctypes.c_float(swiglu_limit),
        ctypes.c_float(swiglu_alpha),
        ctypes.c_float(act_scale),
        ctypes.c_float(1.0 / act_scale),
    ]
    kernel.launch(multiprocessors(device), THREADS, plan.shared_bytes, args, dependent=uses_pdl(device))
