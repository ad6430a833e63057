"""MoE router GEMM at decode sizes: this project's decode router kernel against cuBLAS and
flashinfer's `tinygemm_bf16` (the SM90 small-GEMM SGLang uses for gpt-oss's router).

Shapes: x [T, 2880] bf16 times the router [E, 2880] bf16 plus bias, E = 32 (20b) or 128
(120b), T = 1 and 8. Each call is timed inside a CUDA graph replay, rotating over 24 router
weight copies (one a layer). Rows:
  decode router        `decode_router`: logits in float32, x as the GEMVs' scaled fp16, the
                       output rows zeroed (what the decode MoE path launches)
  ... with add + norm  the same kernel with the residual add and RMSNorm folded in (the engine's case)
  cuBLAS               F.linear, bf16 out
  tinygemm             flashinfer.gemm.tinygemm_bf16, bf16 out (with and without its PDL flag)
  add + norm, tinygemm what replacing the folded router would launch: `add_rms_norm_triton`
                       then tinygemm_bf16
Error: max |logits - float32 reference| / max |reference|.

    python3 benchmarks/bench_router.py [--experts 32,128] [--batches 1,8] [--tinygemm-module PATH]

flashinfer JIT-builds tinygemm's module on first use (nvcc needed). --tinygemm-module loads a
prebuilt one instead: flashinfer's own build of csrc/tinygemm2.cu (`gen_tinygemm2_module()
.build()`), made where nvcc is; if it was linked against a libcuda stub, libcuda is preloaded.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "benchmarks")]

from cuda_timing import time_graph_calls  # noqa: E402  (benchmarks/)

from inference.ops.moe.triton import decode_router  # noqa: E402
from inference.ops.rmsnorm import add_rms_norm_triton  # noqa: E402

HIDDEN = 2880
LAYERS = 24  # router copies rotated over


def load_tinygemm(module: str | None):
    """flashinfer's tinygemm_bf16, or None when flashinfer is absent."""
    try:
        import flashinfer.gemm.routergemm as routergemm
    except ImportError:
        return None
    if module:
        from flashinfer_moe_subset import PrebuiltModule

        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL)  # for a module linked against a stub
        routergemm.gen_tinygemm2_module = lambda: PrebuiltModule(module)
    return routergemm.tinygemm_bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="32,128")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tinygemm-module", help="a prebuilt flashinfer tinygemm2 module (.so)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    tinygemm = load_tinygemm(args.tinygemm_module)
    print(f"device: {torch.cuda.get_device_name(dev)}; flashinfer tinygemm: {'yes' if tinygemm else 'not installed'}")
    print(
        "| experts | T | decode router µs | ... with add + norm | cuBLAS | tinygemm | tinygemm, PDL flag "
        "| add + norm, tinygemm | error: ours / cuBLAS / tinygemm |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    g = torch.Generator(device=dev).manual_seed(0)
    for experts in (int(e) for e in args.experts.split(",")):
        weights = [
            (torch.randn(experts, HIDDEN, generator=g, device=dev) * HIDDEN**-0.5).bfloat16() for _ in range(LAYERS)
        ]
        biases = [(torch.randn(experts, generator=g, device=dev) * 0.02).bfloat16() for _ in range(LAYERS)]
        biases32 = [b.float() for b in biases]  # the decode router's bias, as `prepare_moe_weights` keeps it
        norm_weight = (torch.rand(HIDDEN, generator=g, device=dev) + 0.5).bfloat16()
        for t in (int(b) for b in args.batches.split(",")):
            x = torch.randn(t, HIDDEN, generator=g, device=dev).bfloat16()
            delta = torch.randn(t, HIDDEN, generator=g, device=dev).bfloat16()
            out32 = torch.empty(t, HIDDEN, device=dev)
            out = torch.empty(t, experts, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float(), biases[0].float())

            def error(logits: torch.Tensor) -> float:
                return ((logits.float() - ref).abs().max() / ref.abs().max()).item()

            def ours(i: int, add_norm=None):
                return decode_router(x, weights[i % LAYERS], biases32[i % LAYERS], out32, add_norm)

            errors = [error(ours(0)[1]), error(F.linear(x, weights[0], biases[0]))]
            times = [
                time_graph_calls(ours, LAYERS, 2 * LAYERS),
                time_graph_calls(lambda i: ours(i, (delta, norm_weight, 1e-5)), LAYERS, 2 * LAYERS),
                time_graph_calls(lambda i: F.linear(x, weights[i % LAYERS], biases[i % LAYERS]), LAYERS, 2 * LAYERS),
            ]
            if tinygemm:
                tinygemm(x, weights[0], out, biases[0])
                errors.append(error(out))
                times += [
                    time_graph_calls(
                        lambda i: tinygemm(x, weights[i % LAYERS], out, biases[i % LAYERS]), LAYERS, 2 * LAYERS
                    ),
                    time_graph_calls(
                        lambda i: tinygemm(x, weights[i % LAYERS], out, biases[i % LAYERS], use_pdl=True),
                        LAYERS,
                        2 * LAYERS,
                    ),
                    time_graph_calls(
                        lambda i: (
                            add_rms_norm_triton(x, delta, norm_weight, 1e-5),
                            tinygemm(x, weights[i % LAYERS], out, biases[i % LAYERS]),
                        ),
                        LAYERS,
                        2 * LAYERS,
                    ),
                ]
            cells = [f"{s * 1e6:.2f}" for s in times] + ["—"] * (6 - len(times))
            print(
                f"| {experts} | {t} | " + " | ".join(cells) + " | " + " / ".join(f"{e:.1e}" for e in errors) + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
