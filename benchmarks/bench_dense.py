"""Dense projection benchmark: cuBLAS (`F.linear`) vs the Triton decode GEMV on gpt-oss-20b shapes.

Shapes (in -> out): qkv 2880 -> 5120 with bias, o_proj 4096 -> 2880 with bias, lm_head
2880 -> 201088 without bias, MoE router 2880 -> 32 with bias; bf16, M = 1..64 token rows.
Each call is timed as the engine runs it, inside a CUDA graph replay, rotating over enough weight
copies (>= 256 MB together, 1024 at most) that L2 (60 MB on an H200) cannot hold them; the
router's 184 KB is launch-bound whatever the rotation. Bytes = W + bias + x + y, once each; the
ceiling is device-to-device copy bandwidth (read + write) measured in the same process.

    python3 benchmarks/bench_dense.py [--check] [--sweep] [--m 1,2,4,8] [--json out.json]

--check: relative L2 error of each implementation vs the float32 reference (`linear_reference`).
--sweep: times a grid of launch configurations (both inner products, tile sizes, split-K) for
qkv and o_proj at M = 1, 4, 8 (or --sweep-shapes / --sweep-m) and prints the best beside the
heuristic's choice, the evidence for `linear_config`'s defaults and `GEMV_MAX_TOKENS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from copy_bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/, the script's folder)
from cuda_timing import time_graph_calls  # noqa: E402

from inference.ops.linear.backend import GEMV_MAX_TOKENS  # noqa: E402
from inference.ops.linear.triton import (  # noqa: E402
    LinearConfig,
    linear_config,
    linear_reference,
    linear_triton,
)
from inference.ops.multiprocessors import multiprocessors  # noqa: E402

DEV = torch.device("cuda")
# name -> (in_features K, out_features N, bias)
SHAPES = {
    "qkv": (2880, 5120, True),
    "o_proj": (4096, 2880, True),
    "lm_head": (2880, 201088, False),
    "router": (2880, 32, True),
}
LAYERS = 24  # gpt-oss-20b: qkv and o_proj run once per layer per step
ROTATION_BYTES = 256 << 20
MAX_COPIES = 1024


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Problem:
    """One shape's weight copies (rotated so L2 holds none of them between uses) and inputs."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.k, self.n, has_bias = SHAPES[name]
        g = torch.Generator(device=DEV).manual_seed(seed)
        w_bytes = self.n * self.k * 2
        self.copies = max(1, min(MAX_COPIES, math.ceil(ROTATION_BYTES / w_bytes)))
        self.weights = [
            torch.randn(self.n, self.k, generator=g, device=DEV, dtype=torch.bfloat16) * self.k**-0.5
            for _ in range(self.copies)
        ]
        self.biases = [
            torch.randn(self.n, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02 if has_bias else None
            for _ in range(self.copies)
        ]
        self.calls = max(20, self.copies)
        self._x: dict[int, torch.Tensor] = {}

    def x(self, m: int) -> torch.Tensor:
        if m not in self._x:
            g = torch.Generator(device=DEV).manual_seed(m)
            self._x[m] = torch.randn(m, self.k, generator=g, device=DEV, dtype=torch.bfloat16)
        return self._x[m]

    def bytes(self, m: int) -> int:
        bias = self.n * 2 if self.biases[0] is not None else 0
        return self.n * self.k * 2 + bias + m * self.k * 2 + m * self.n * 2

    def seconds(self, m: int, impl: str, cfg: LinearConfig | None = None) -> float:
        x = self.x(m)
        c = self.copies
        if impl == "cublas":

            def run(i):
                return F.linear(x, self.weights[i % c], self.biases[i % c])
        else:

            def run(i):
                return linear_triton(x, self.weights[i % c], self.biases[i % c], cfg)

        return time_graph_calls(run, c, self.calls)

    def errors(self, m: int) -> dict:
        """Relative L2 error of cuBLAS and of the Triton kernel vs the float32 reference."""
        x, w, b = self.x(m), self.weights[0], self.biases[0]
        ref = linear_reference(x.float(), w, b).float()

        def rel(y):
            return ((y.float() - ref).norm() / ref.norm()).item()

        return dict(cublas=rel(F.linear(x, w, b)), triton=rel(linear_triton(x, w, b)))


def sweep_configs(m: int) -> list[LinearConfig]:
    """The launch shapes --sweep tries at M = m (the fma inner product only at M = 1)."""
    configs = []
    if m == 1:
        for bn, bk, warps, split in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (1, 2)):
            configs.append(LinearConfig(bn, bk, split, warps, num_stages=1))
        for bn, bk in ((4, 512), (8, 512), (8, 256), (16, 256)):
            configs.append(LinearConfig(bn, bk, 1, 4, num_stages=3))
    for bn, bk, stages, split in itertools.product((16, 32, 64), (64, 128, 256), (3, 4), (1, 2, 4)):
        if bn * bk <= 64 * 128:  # larger tiles need more shared memory per stage than they save
            configs.append(LinearConfig(bn, bk, split, 4, stages, dot=True))
    return configs


def run_sweep(problem: Problem, m: int, bandwidth: float) -> dict:
    sms = multiprocessors(DEV)
    default = linear_config(m, problem.n, problem.k, sms)
    results = []
    for cfg in sweep_configs(m) + [default]:
        try:
            results.append((problem.seconds(m, "triton", cfg), cfg))
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects (e.g. out of shared memory)
            progress(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
    results.sort(key=lambda r: r[0])
    default_s = next(s for s, c in results if c == default)
    cublas = problem.seconds(m, "cublas")
    print(
        f"\n{problem.name} M={m}: cuBLAS {cublas * 1e6:.1f} us; heuristic {default} {default_s * 1e6:.1f} us "
        f"(rank {[c for _, c in results].index(default) + 1} of {len(results)})"
    )
    for s, cfg in results[:5]:
        pct = problem.bytes(m) / s / bandwidth * 100
        print(f"  {s * 1e6:7.1f} us {pct:5.1f}% of copy  {cfg}")
    return dict(
        shape=problem.name,
        m=m,
        cublas_s=cublas,
        default=dataclasses.asdict(default),
        default_s=default_s,
        ranked=[dict(seconds=s, **dataclasses.asdict(c)) for s, c in results],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8,16,32,64", help="token rows to time")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="which of " + ", ".join(SHAPES))
    ap.add_argument("--check", action="store_true", help="also print each one's error vs float32")
    ap.add_argument("--sweep", action="store_true", help="also try other launch configurations")
    ap.add_argument("--sweep-shapes", default="qkv,o_proj")
    ap.add_argument("--sweep-m", default="1,4,8")
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]

    bandwidth = copy_bandwidth()
    props = torch.cuda.get_device_properties(DEV)
    print(
        f"{props.name}, {props.multi_processor_count} SMs; copy bandwidth {bandwidth / 1e12:.2f} TB/s "
        f"(read + write); GEMV_MAX_TOKENS = {GEMV_MAX_TOKENS}"
    )
    results: dict = dict(device=props.name, copy_bandwidth=bandwidth, rows=[], sweep=[])
    header = (
        f"{'shape':8} {'M':>3} | {'cuBLAS us':>9} {'GB/s':>6} {'%copy':>5} | {'Triton us':>9} {'GB/s':>6} "
        f"{'%copy':>5} | {'faster':7} | Triton config"
    )
    if args.check:
        header += " | rel err cuBLAS, Triton"
    print(header)
    totals = {"cublas": 0.0, "triton": 0.0}
    for name in args.shapes.split(","):
        progress(f"{name}: making weight copies")
        problem = Problem(name)
        for m in ms:
            cfg = linear_config(m, problem.n, problem.k, multiprocessors(DEV))
            row = dict(
                shape=name,
                m=m,
                bytes=problem.bytes(m),
                config=dataclasses.asdict(cfg),
                cublas_s=problem.seconds(m, "cublas"),
                triton_s=problem.seconds(m, "triton"),
            )
            line = f"{name:8} {m:3} |"
            for impl in ("cublas", "triton"):
                s = row[f"{impl}_s"]
                rate = row["bytes"] / s
                line += f" {s * 1e6:9.1f} {rate / 1e9:6.0f} {rate / bandwidth * 100:5.1f} |"
            row["faster"] = "Triton" if row["triton_s"] < row["cublas_s"] else "cuBLAS"
            line += (
                f" {row['faster']:7} | bn={cfg.block_n} bk={cfg.block_k} split={cfg.split_k} "
                f"{'dot' if cfg.dot else 'fma'} w={cfg.num_warps} st={cfg.num_stages}"
            )
            if args.check:
                row["rel_err"] = problem.errors(m)
                line += f" | {row['rel_err']['cublas']:.1e}, {row['rel_err']['triton']:.1e}"
            print(line, flush=True)
            results["rows"].append(row)
            if m == 1 and name in ("qkv", "o_proj"):
                for impl in totals:
                    totals[impl] += row[f"{impl}_s"] * LAYERS
        del problem
        torch.cuda.empty_cache()
    if all(totals.values()):
        print(
            f"\nbatch 1, qkv + o_proj over {LAYERS} layers: cuBLAS {totals['cublas'] * 1e6:.0f} us, "
            f"Triton {totals['triton'] * 1e6:.0f} us a token"
        )
    if args.sweep:
        for name in args.sweep_shapes.split(","):
            problem = Problem(name)
            for m in (int(v) for v in args.sweep_m.split(",")):
                progress(f"sweep {name} M={m}")
                results["sweep"].append(run_sweep(problem, m, bandwidth))
            del problem
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
