"""What a programmatic-dependent-launch wait costs against an ordinary launch, by program count.

A CUDA graph replays 24 "layers" of A -> B:
  * A streams 24 MB of bf16 (528 programs of 4 warps, one 24 MB buffer a layer, so that L2 does
    not hold it), waits for its predecessor first thing and lets its successor launch at its
    start, as the engine's weight-streaming kernels do;
  * B is tiny: each of its programs reads and writes 64 bytes. It is launched either the
    ordinary way (only letting its successor launch early) or as a dependent that waits first
    thing, with nothing before the wait.
It prints µs a layer for A alone, then for A -> B both ways, for B grids of 8 to 1,440 programs
of 1 or 4 warps (1,440 one-warp programs is the MoE gate_up GEMV's grid at batch 1). The
difference between the two B columns is what the wait saves or costs against a launch, behind a
long streaming kernel and with nothing placed before the wait (docs/benchmark-log.md, "Serial round trips
out of the decode chain"). Each cell is one timed window of 50 replays, the ordinary launch
always timed just before the dependent one.

    python3 experiments/pdl_chain.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "benchmarks")]

from cuda_timing import graph_replay_seconds  # noqa: E402  (benchmarks/)

from inference.ops.dependent_launch import TRIGGER, WAIT, wait_for_previous  # noqa: E402

LAYERS = 24
REPLAYS = 50
STREAM_PROGRAMS = 528
STREAM_BLOCK = 1024  # values a load step


@triton.jit
def _stream_kernel(X, Y, n_per, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums X[p * n_per : (p + 1) * n_per] (bf16) in BLOCK-wide float32 lanes into Y."""
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_per, BLOCK):
        acc += tl.load(X + pid * n_per + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Y + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _tiny_kernel(X, Y, PDL: tl.constexpr):
    """Program p: Y[16p : 16p + 16] = X[16p : 16p + 16] + 1 (float32)."""
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    v = tl.load(X + pid * 16 + tl.arange(0, 16))
    tl.store(Y + pid * 16 + tl.arange(0, 16), v + 1.0)


def chain_us(b_programs: int, b_warps: int, dependent: bool) -> float:
    """µs a layer of the replayed chain; b_programs 0 leaves B out (A alone)."""
    dev = torch.device("cuda")
    n_per = 24 * 2**20 // 2 // STREAM_PROGRAMS // STREAM_BLOCK * STREAM_BLOCK
    xs = [torch.randn(STREAM_PROGRAMS * n_per, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ya = torch.empty(STREAM_PROGRAMS * STREAM_BLOCK, device=dev)
    tx = torch.randn(max(b_programs, 1) * 16, device=dev)
    ty = torch.empty_like(tx)

    def step():
        for x in xs:
            _stream_kernel[(STREAM_PROGRAMS,)](
                x, ya, n_per, PDL=WAIT | TRIGGER, BLOCK=STREAM_BLOCK, num_warps=4, launch_pdl=True
            )
            if b_programs == 0:
                continue
            if dependent:
                _tiny_kernel[(b_programs,)](tx, ty, PDL=WAIT | TRIGGER, num_warps=b_warps, launch_pdl=True)
            else:
                _tiny_kernel[(b_programs,)](tx, ty, PDL=TRIGGER, num_warps=b_warps)

    return graph_replay_seconds(step, REPLAYS, warmup=5) * 1e6 / LAYERS


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("needs a Hopper or later GPU (programmatic dependent launch)")
    print(f"{torch.cuda.get_device_name()}; µs a layer, {LAYERS} layers a graph, {REPLAYS} replays")
    print("| A alone | | %.2f, %.2f |" % (chain_us(0, 1, False), chain_us(0, 1, False)), flush=True)
    print("| B programs | warps | ordinary/dependent, round 1 (µs a layer) | round 2 |", flush=True)
    for warps in (1, 4):
        for programs in (8, 132, 528, 1440):
            rounds = []
            for _ in range(2):
                ordinary, dependent = chain_us(programs, warps, False), chain_us(programs, warps, True)
                rounds.append(f"{ordinary:.2f}/{dependent:.2f}")
            print(f"| {programs} | {warps} | " + " | ".join(rounds) + " |", flush=True)


if __name__ == "__main__":
    main()
