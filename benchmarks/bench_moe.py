"""One gpt-oss MoE layer on one GPU: time, bandwidth against the measured copy bandwidth, TFLOP/s.

Builds one layer's router and MXFP4 experts with random weights of the real shapes directly on
the GPU (20b: 32 experts, 120b: 128; H = I = 2880, top-4), then times each chosen backend's
forward (router, expert kernels, combine) replayed from a CUDA graph at each batch size: the same
weights and inputs for every backend, and with several backends a "winner" row per batch.
The graph runs `--layers` layers of different weights back to back and the time is per layer:
as in the model, each layer finds its experts out of L2 (a replay of one layer would find some
of its 53 MB at batch 1 still in the 50 MB L2), and its first kernel overlaps the layer before.

    bytes    = every expert the batch routes to (MXFP4 blocks + scales + fp32 biases)
               + the router + activations in and out
    The output is what the model asks for (float32 sums from the Triton kernels, no cast).
    TFLOP/s  = 2 * T * top_k * 3 * H * I / time (router excluded)

    python benchmarks/bench_moe.py
    python benchmarks/bench_moe.py --models 20b --batches 1,2048 --profile   # per-kernel times
    python benchmarks/bench_moe.py --sweep                                   # try launch configs
    python benchmarks/bench_moe.py --variant narrow_blocks=1 --variant narrow_blocks=0   # these configs
    python benchmarks/bench_moe.py --batches 1 --persistent both             # one launch vs the GEMVs
    python benchmarks/bench_moe.py --backends triton,flashinfer --check      # both, vs the reference
    python benchmarks/bench_moe.py --backends triton,flashinfer --flashinfer-tactics   # each tactic

flashinfer's own autotuner needs more of its JIT modules than the fused MoE (it fails on a
machine with only that one); `--flashinfer-tactics` times its tactics by index instead: every
GEMM1 tactic with GEMM2's default, then every GEMM2 tactic with the fastest GEMM1. Tactics a
build lacks (see `experiments/flashinfer_moe_subset.py`) fail before launching and are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from copy_bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/, the script's folder)
from cuda_timing import graph_replay_seconds  # noqa: E402

from inference.ops.moe import persistent  # noqa: E402
from inference.ops.moe.backend import TritonMoEBackend, model_output_dtype, select_moe_backend  # noqa: E402
from inference.ops.moe.reference import ExpertWeights, MoEWeights, moe_reference, route  # noqa: E402
from inference.ops.moe.triton import MoEKernelConfig, takes_decode_path  # noqa: E402

HIDDEN = INTERMEDIATE = 2880
TOP_K = 4
SWIGLU_LIMIT = 7.0
EXPERTS = {"20b": 32, "120b": 128}
MAX_TACTICS = 10_000  # a bound on `--flashinfer-tactics` per GEMM, should no index be refused

# Launch variants tried by --sweep (fields of MoEKernelConfig; the rest keep their defaults).
DECODE_SWEEP = [
    dict(),
    dict(gemv_block_u=4),
    dict(gemv_block_u=4, gemv_stages=3),
    dict(gemv_stages=3),
    dict(gemv_stages=5),
    dict(gemv_warps=2),
]
DECODE_SWEEP_MAX_BATCH = 16  # up to here both paths are timed
GROUPED_SWEEP = [
    dict(),
    dict(block_m=16),
    dict(block_m=32),
    dict(block_m=64),
    dict(block_m=128),
    dict(down_block_n=128),
    dict(down_block_n=32),
    dict(block_n=32),
    dict(block_n=128),
    dict(warps=8),
    dict(stages=1),
    dict(stages=2),
    dict(stages=4),
    dict(stages=2, maxnreg=128),
    dict(block_n=128, warps=8, down_warps=4),
    dict(block_n=128, down_block_n=128, warps=8),
    dict(block_n=128, down_block_n=128, warps=8, stages=2),
    dict(router_programs=256),
]
GROUPED_SWEEP_BATCHES = {
    "20b": (64, 128, 256, 512, 1024, 2048),
    "120b": (64, 128, 256, 512, 1024, 2048),
}  # where grouped variants are compared


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_layer(num_experts: int, seed: int = 0) -> MoEWeights:
    """Random MXFP4 experts (scales 2^-10..2^-6, like `inference.model.gpt_oss.random_tensor_source`)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, i, e = HIDDEN, INTERMEDIATE, num_experts

    def u8(*shape, low=0, high=256):
        return torch.randint(low, high, shape, generator=g, device="cuda", dtype=torch.uint8)

    def normal(*shape, std):
        return torch.randn(shape, generator=g, device="cuda") * std

    experts = ExpertWeights(
        gate_up_bias=normal(e, 2 * i, std=0.02),
        down_bias=normal(e, h, std=0.02),
        gate_up_blocks=u8(e, 2 * i, h // 32, 16),
        gate_up_scales=u8(e, 2 * i, h // 32, low=117, high=122),
        down_blocks=u8(e, h, i // 32, 16),
        down_scales=u8(e, h, i // 32, low=117, high=122),
    )
    return MoEWeights(
        router_weight=normal(e, h, std=h**-0.5).bfloat16(), router_bias=normal(e, std=0.02).bfloat16(), experts=experts
    )


def expert_bytes(h: int, i: int) -> int:
    """Bytes one expert must read: MXFP4 values (4 bits), one scale byte per 32, fp32 biases."""
    weights = 2 * i * h + h * i
    return weights // 2 + weights // 32 + (2 * i + h) * 4


def profile_kernels(fn, iters: int = 20, per_call: int = 1) -> list[tuple[str, float]]:
    """Mean GPU microseconds of each kernel `fn` launches, per call divided by per_call (the
    layers one call runs)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if total > 0:
            rows.append((evt.key[:60], total / iters / per_call))
    return sorted(rows, key=lambda r: -r[1])


def sweep_flashinfer_tactics(backend, forward, iters: int) -> tuple[list[int], float, str]:
    """Time `forward` (a graph-capturable call of the flashinfer backend) under each GEMM tactic.

    Returns ([gemm1, gemm2] of the fastest pair, its seconds, "ran/all" counts of both GEMMs).
    flashinfer numbers the tactics in one list, GEMM1's first; an index past a GEMM's range is
    refused with "Invalid gemm<N> profile id", which ends that GEMM's sweep."""

    def sweep(ids_for, start: int) -> tuple[dict[int, float], int]:
        times = {}
        for index in range(start, start + MAX_TACTICS):
            backend.profile_ids = ids_for(index)
            try:
                times[index] = graph_replay_seconds(forward, iters)
            except Exception as exc:  # a tactic this build lacks, or one the shape refuses
                if "Invalid gemm" in str(exc):
                    return times, index
        return times, start + MAX_TACTICS

    try:
        first, gemm1_end = sweep(lambda i: [i, -1], 0)
        if not first:
            raise RuntimeError("no GEMM1 tactic ran")
        gemm1 = min(first, key=first.get)
        second, gemm2_end = sweep(lambda j: [gemm1, j], gemm1_end)
        if not second:
            raise RuntimeError("no GEMM2 tactic ran")
    finally:
        backend.profile_ids = None
    gemm2 = min(second, key=second.get)
    counts = f"{len(first)}/{gemm1_end} and {len(second)}/{gemm2_end - gemm1_end} ran"
    return [gemm1, gemm2], second[gemm2], counts


def prepare_copy(backend, weights: MoEWeights):
    """prepare() releases the packed tensors it is given: hand it a shallow copy, so every
    backend (and the reference check) starts from the same checkpoint tensors."""
    return backend.prepare(dataclasses.replace(weights, experts=dataclasses.replace(weights.experts)))


def float_copy(weights: MoEWeights) -> MoEWeights:
    """The layer with its router in float32, as the reference routes."""
    return dataclasses.replace(
        weights, router_weight=weights.router_weight.float(), router_bias=weights.router_bias.float()
    )


def each_layer(backend, x: torch.Tensor, layers: list, **kwargs):
    """One timed call: backend.forward(x) through each prepared layer in turn."""

    def forward():
        for layer in layers:
            backend.forward(x, layer, TOP_K, SWIGLU_LIMIT, **kwargs)

    return forward


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def parse_variant(text: str) -> dict:
    """Parse "narrow_blocks=0,block_m=64" into {"narrow_blocks": False, "block_m": 64}, typed by the
    MoEKernelConfig field (ints, bools as 0/1, floats, None)."""
    types = {f.name: f.type for f in dataclasses.fields(MoEKernelConfig)}
    variant = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in types:
            raise argparse.ArgumentTypeError(f"MoEKernelConfig has no field {name!r}")
        kind = types[name]
        if value == "None":
            variant[name] = None
        elif "bool" in kind:
            variant[name] = value not in ("0", "false", "False")
        elif "float" in kind:
            variant[name] = float(value)
        else:
            variant[name] = int(value)
    return variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="20b,120b")
    ap.add_argument("--batches", default="1,8,64,256,2048")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--layers",
        type=int,
        default=4,
        help="layers of different weights run in turn per timed call (the time is per layer)",
    )
    ap.add_argument(
        "--backends",
        default="triton",
        help="comma-separated MoE backends timed on the same weights and inputs: triton, flashinfer",
    )
    ap.add_argument(
        "--sweep", action="store_true", help="also time the Triton variants in DECODE_SWEEP and GROUPED_SWEEP"
    )
    ap.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        metavar="FIELD=VALUE[,FIELD=VALUE]",
        help="time the Triton backend with these MoEKernelConfig fields (repeatable; instead of the default "
        "and the sweep), e.g. --variant narrow_blocks=1 --variant narrow_blocks=0",
    )
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU times for the first model's batches")
    ap.add_argument(
        "--persistent",
        choices=("on", "off", "both"),
        default="both",
        help="at one token: the persistent MoE kernel after the router (on), the two Triton GEMVs (off), or both",
    )
    ap.add_argument(
        "--persistent-timeline",
        action="store_true",
        help="build the persistent kernel with -DTIMELINE and print when its CTAs pass each phase",
    )
    ap.add_argument(
        "--persistent-load-only",
        action="store_true",
        help="build the persistent kernel with -DLOAD_ONLY: its loads and barriers without the arithmetic "
        "(wrong results; the time of its structure)",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="print each backend's relative error against the float32 reference per batch",
    )
    ap.add_argument(
        "--autotune",
        action="store_true",
        help="let flashinfer profile its GEMM tactics for these batches before timing",
    )
    ap.add_argument(
        "--flashinfer-tactics",
        action="store_true",
        help="also time flashinfer's GEMM tactics one by one and report the fastest pair",
    )
    ap.add_argument(
        "--flashinfer-module",
        metavar="PATH",
        help="a fused_moe_90 library built by experiments/flashinfer_moe_subset.py, used instead of flashinfer's "
        "JIT module (its other JIT modules are then not built either: torch routes)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU")
    names = args.backends.split(",")
    if args.flashinfer_module:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
        from flashinfer_moe_subset import use_prebuilt

        use_prebuilt(args.flashinfer_module)

    persistent.EXTRA_DEFINES = ("-DLOAD_ONLY",) * args.persistent_load_only
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print("| model | batch | path | config | time (us) | experts read | GB/s | % of copy | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    batches = [int(b) for b in args.batches.split(",")]
    for model_index, model in enumerate(args.models.split(",")):
        progress(f"building {args.layers} random {model} MoE layer(s)")
        layers = [random_layer(EXPERTS[model], seed) for seed in range(args.layers)]
        weights = layers[0]
        backends = {
            name: TritonMoEBackend() if name == "triton" else select_moe_backend("cuda", name) for name in names
        }
        if args.flashinfer_module and "flashinfer" in backends:
            backends["flashinfer"].tinygemm_max_tokens = 0  # tinygemm is a JIT module of its own
        prepared = {}
        for name, backend in backends.items():
            progress(f"preparing the {name} backend's weights")
            prepared[name] = [prepare_copy(backend, layer) for layer in layers]
            if args.autotune and name == "flashinfer":
                progress(f"autotuning flashinfer for batches {batches}")
                backend.autotune(prepared[name][0], TOP_K, SWIGLU_LIMIT, batches)
        float_layers = [float_copy(layer) for layer in layers]
        float_router = float_layers[0]
        per_expert = expert_bytes(HIDDEN, INTERMEDIATE)
        router_bytes = weights.router_weight.numel() * 2 + weights.router_bias.numel() * 4
        for t in batches:
            x = (torch.randn(t, HIDDEN, device="cuda") * 0.5).bfloat16()
            # experts read a layer, averaged over the layers (each routes x its own way)
            touched = sum(torch.unique(route(x.float(), layer, TOP_K)[0]).numel() for layer in float_layers) / len(
                layers
            )
            moved = touched * per_expert + router_bytes + 2 * x.numel() * 2
            flops = 2 * t * TOP_K * 3 * HIDDEN * INTERMEDIATE
            best = {}  # backend -> seconds of its fastest configuration
            for name, backend in backends.items():
                if name == "triton":
                    default = backend.config
                    variants = [dict()]
                    if args.variant:
                        variants = args.variant
                    elif args.sweep and t <= DECODE_SWEEP_MAX_BATCH:
                        variants = [
                            dict(decode_max_tokens=t, decode_max_pairs_per_expert=None, **v) for v in DECODE_SWEEP
                        ]
                        variants.append(dict(decode_max_tokens=0))
                    elif args.sweep and t in GROUPED_SWEEP_BATCHES.get(model, ()):
                        variants = [dict(decode_max_tokens=0, **v) for v in GROUPED_SWEEP]
                    runs = []
                    for variant in variants:
                        config = dataclasses.replace(default, **variant)
                        path = "gemv" if takes_decode_path(t, TOP_K, EXPERTS[model], config) else "grouped"
                        runs.append((path, variant, TritonMoEBackend(config)))
                else:
                    runs = [("cutlass", dict(), backend)]
                    if args.flashinfer_tactics:
                        try:
                            ids, seconds, counts = sweep_flashinfer_tactics(
                                backend, each_layer(backend, x, prepared[name]), args.iters
                            )
                            seconds /= args.layers
                        except Exception as exc:
                            print(
                                f"| {model} | {t} | {name} tactics | failed: {type(exc).__name__}: {str(exc)[:120]} |"
                            )
                        else:
                            best[name] = seconds
                            print(
                                f"| {model} | {t} | {name} cutlass | tactics {ids} (fastest; {counts}) | "
                                f"{seconds * 1e6:.1f} | {touched:g} | {moved / seconds / 1e9:.0f} | "
                                f"{100 * moved / seconds / bandwidth:.0f}% | {flops / seconds / 1e12:.1f} |",
                                flush=True,
                            )
                if name == "triton" and persistent.supported(x, EXPERTS[model], HIDDEN, INTERMEDIATE, TOP_K):
                    modes = {"on": [True], "off": [False], "both": [True, False]}[args.persistent]
                    runs = [
                        ("persistent" if on else path, variant, bench, on)
                        for path, variant, bench in runs
                        for on in (modes if path == "gemv" else [False])
                    ]
                else:
                    runs = [(path, variant, bench, False) for path, variant, bench in runs]
                for path, variant, bench, persistent_on in runs:
                    label = f"{name} {path}" if len(names) > 1 else path
                    persistent.set_enabled(persistent_on)
                    try:
                        forward = each_layer(bench, x, prepared[name], out_dtype=model_output_dtype(bench))
                        seconds = graph_replay_seconds(forward, args.iters) / args.layers
                    except Exception as exc:  # a variant that does not compile must not end the sweep
                        print(
                            f"| {model} | {t} | {label} | {variant or 'default'} | failed: {type(exc).__name__}: "
                            f"{str(exc)[:120]} |"
                        )
                        continue
                    best[name] = min(seconds, best.get(name, seconds))
                    print(
                        f"| {model} | {t} | {label} | {variant or 'default'} | {seconds * 1e6:.1f} | {touched:g} | "
                        f"{moved / seconds / 1e9:.0f} | {100 * moved / seconds / bandwidth:.0f}% | "
                        f"{flops / seconds / 1e12:.1f} |",
                        flush=True,
                    )
            persistent.set_enabled(args.persistent != "off")  # what --check and --profile run
            if args.persistent_timeline and persistent.supported(x, EXPERTS[model], HIDDEN, INTERMEDIATE, TOP_K):
                persistent.set_enabled(True)
                timed_build = persistent.EXTRA_DEFINES
                persistent.EXTRA_DEFINES = timed_build + ("-DTIMELINE",)  # the stamps stay out of the timed runs
                each_layer(backends["triton"], x, prepared["triton"], out_dtype=torch.float32)()
                torch.cuda.synchronize()
                persistent.EXTRA_DEFINES = timed_build
                print(
                    f"    persistent kernel, {model} T={t}, the last layer: µs after the first CTA starts (median / max)"
                )
                for event, (median, most) in persistent.timeline(x.device).items():
                    print(f"      {event:30s} {median:7.2f} {most:7.2f}")
                persistent.set_enabled(args.persistent != "off")
            if len(best) > 1:
                ranked = sorted(best, key=best.get)
                print(
                    f"| {model} | {t} | winner | {ranked[0]} ({best[ranked[1]] / best[ranked[0]]:.2f}x vs "
                    f"{ranked[1]}) | {best[ranked[0]] * 1e6:.1f} | | | | |",
                    flush=True,
                )
            if args.check:
                ref = moe_reference(x.float(), float_router, TOP_K, SWIGLU_LIMIT)
                for name, backend in backends.items():
                    out = backend.forward(
                        x, prepared[name][0], TOP_K, SWIGLU_LIMIT, out_dtype=model_output_dtype(backend)
                    )
                    print(
                        f"    check {name} T={t}: |out - ref| / |ref| = {relative_error(out, ref):.2e} "
                        f"(finite: {bool(torch.isfinite(out).all())})",
                        flush=True,
                    )
            if args.profile and model_index == 0:
                for name, backend in backends.items():
                    fn = each_layer(backend, x, prepared[name], out_dtype=model_output_dtype(backend))
                    for kernel, us in profile_kernels(fn, per_call=args.layers)[:8]:
                        print(f"    {name} T={t}: {us:8.1f} us  {kernel}")
        weights = layers = float_layers = float_router = prepared = backends = (
            None  # free this model's layer before the next
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
