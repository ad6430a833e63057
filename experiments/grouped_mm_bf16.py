"""The two expert GEMMs of a 20b MoE layer as CUTLASS bf16 grouped GEMMs
(`torch.nn.functional.grouped_mm`), for comparison with `benchmarks/bench_moe.py`.

A lower bound for a layer on bf16 copies of the experts: the activations are already gathered
in expert order (each expert's rows padded to 16), and there is no routing, SwiGLU or combine.
Random bf16 weights of 20b's shapes (32 experts, H = I = 2880, top-4), uniform routing; each
GEMM replayed from a CUDA graph over 3 layers of different weights; µs a layer.

    python3 experiments/grouped_mm_bf16.py [--tokens 512,768,1024,1280,2048,4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import graph_replay_seconds  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, LAYERS = 32, 2880, 2880, 4, 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,768,1024,1280,2048,4096")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    gate_up = [torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda").bfloat16() for _ in range(LAYERS)]
    down = [torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, device="cuda").bfloat16() for _ in range(LAYERS)]
    print("| tokens | rows (padded) | gate_up (us) | down (us) | both | TFLOP/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in (int(v) for v in args.tokens.split(",")):
        ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(t)])
        counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
        offs = torch.cumsum((counts + 15) // 16 * 16, 0).int()
        rows = int(offs[-1])
        x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
        act = torch.randn(rows, INTERMEDIATE, device="cuda").bfloat16()
        first = graph_replay_seconds(
            lambda: [F.grouped_mm(x, w.transpose(1, 2), offs=offs) for w in gate_up], args.iters
        )
        second = graph_replay_seconds(
            lambda: [F.grouped_mm(act, w.transpose(1, 2), offs=offs) for w in down], args.iters
        )
        first, second = first / LAYERS, second / LAYERS
        flops = 2 * t * TOP_K * 3 * HIDDEN * INTERMEDIATE
        print(
            f"| {t} | {rows} | {first * 1e6:.1f} | {second * 1e6:.1f} | {(first + second) * 1e6:.1f} | "
            f"{flops / (first + second) / 1e12:.0f} |"
        )


if __name__ == "__main__":
    main()
