"""Programmatic dependent launch (PDL, Hopper and later): a kernel brought up while the one before it
still runs, so that its launch, placement and first loads overlap the other's tail.

A batch-1 decode step is about 190 kernels of a few microseconds each. At every boundary the GPU
waits for the next launch, the placement of its programs and their first loads, with its memory
bandwidth idle. A kernel launched with PDL (`launch_pdl=True`) is placed as soon as every program
of the kernel before it has passed `wait_for_previous` (which also lets the next one launch). It
may do work that needs nothing the previous kernel writes, such as loading weights, and then waits
in `wait_for_previous` until the previous kernel has completed and its writes are visible.

The rules every kernel taking a `PDL: tl.constexpr` follows:
- before `wait_for_previous(PDL)` it writes nothing, and reads only what no kernel in flight
  writes: weights, or the output of the kernel two back (complete: the kernel in between either
  was launched the ordinary way, after it, or waited for it before letting this one launch; the
  MoE down GEMV reads the router's logits there);
- after it, everything earlier in the stream is complete, as with ordinary launches.

Which kernels launch as dependents is measured, not assumed (docs/benchmark-log.md, "Programmatic
dependent launch"): the decode GEMVs for qkv and o_proj (their first weight tile and bias loaded
before the wait), the MoE down GEMV (its expert picked and its bias read before the wait), the
decode router and the add + RMSNorm kernel (the router's rows and bias, the norm weight read
before it), decode attention's split combine, and up to 64 tokens the MoE's grouped path (router,
top-k, align, the two grouped GEMMs). Decode attention and the MoE gate_up GEMV only let their
successor launch early: as dependents their waiting programs slowed the kernel before them
(batch 1: 581 and 526 tok/s against 595 without; attention again 641-642 against 660-663 with its
metadata, RoPE factors and sinks loaded before the wait, and 657 when the qkv GEMV let it launch
only after its loop; on 2026-11-25 gate_up 609 and attention 634 against 657, attention with its
first key block loaded before the wait 649-654 against 653-657). Each dependent above, launched
the ordinary way instead, was 0.4-3% slower that day. Where the previous kernel never signals
(cuBLAS, torch ops), a PDL launch starts when it ends, like an ordinary one. CUDA graph capture
keeps the programmatic edges. `OSS_AGENT_PDL=0` turns it all off.
"""

from __future__ import annotations

import functools
import os

import torch

from inference.device import cuda_index

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without grid dependency control (before 3.4): PDL stays off
    triton = None

WAIT, TRIGGER = 1, 2  # the bits of a kernel's `PDL` constexpr
_enabled = os.environ.get("OSS_AGENT_PDL", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Turn PDL on or off for launches from now on (benchmarks compare both; kernels already
    captured in a CUDA graph keep how they were launched)."""
    global _enabled
    _enabled = enabled


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` use PDL: a Hopper or later GPU, a Triton with grid dependency
    control, not the interpreter, not turned off."""
    if not _enabled or triton is None or device.type != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _hopper_or_later(cuda_index(device))


def pdl_options(device: torch.device, dependent: bool) -> dict:
    """Launch keywords for a kernel taking `PDL: tl.constexpr`. Where PDL is used, every such
    kernel lets its successor launch early; `dependent` ones are themselves launched early."""
    if not uses_pdl(device):
        return {"PDL": 0}
    if dependent:
        return {"PDL": WAIT | TRIGGER, "launch_pdl": True}
    return {"PDL": TRIGGER}


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """With the WAIT bit: wait until the kernel before this one has completed and its writes
        are visible. With the TRIGGER bit: then let the next kernel launch. Otherwise a no-op."""
        if PDL & 1:
            gdc_wait()
        if PDL & 2:
            gdc_launch_dependents()
