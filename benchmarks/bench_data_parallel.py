"""Data parallelism through HTTP: N engine replicas behind one server against one replica.

Builds gpt-oss-20b (or -120b) with random weights, first as one engine (`oss-agent serve`'s
default: the engine in a process of its own on cuda:0), then as N replicas on cuda:0..N-1
(`oss-agent serve --data-parallel-size N`: `inference/engine/replicas.py`), serves each over
loopback HTTP in this process and drives it with `oss-agent bench serve` (Chat API, streaming,
processes of its own) at the same concurrency per replica: C in flight against one replica, N*C
against N. Every prompt starts with the same system-prompt-like prefix (`--shared-prefix-len`),
so the prefix-cache hit rate (the server's own cached / prompt tokens) shows whether routing keeps
each replica's cache as useful as one engine's. The engine flags are `oss-agent serve`'s
(`--device`, `--engine-option`, ...), with `--max-model-len` 4096 unless given.

    python benchmarks/bench_data_parallel.py --model 20b --replicas 2 --concurrency 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_server.bench import engine as bench_engine  # noqa: E402
from agent_server.bench.report import format_summary, json_safe  # noqa: E402
from agent_server.cli import serve as serve_command  # noqa: E402


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_args(base: argparse.Namespace, replicas: int, args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(
        **{
            **vars(base),
            "data_parallel_size": replicas,
            "max_concurrency": args.concurrency * replicas,
            "num_prompts": args.requests * replicas,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "shared_prefix_len": args.shared_prefix_len,
            "client_processes": args.client_processes,
            "warmup": 1,
        }
    )


async def measure(engine, run: argparse.Namespace) -> dict[str, Any]:
    async with bench_engine.loopback_server(engine) as base_url:
        # An unmeasured wave at the run's concurrency: compiles each batch shape's kernels and
        # puts the shared prefix in every replica's cache, as a running server would have it.
        progress(f"  a warm-up wave of {run.max_concurrency} requests, not measured")
        await bench_engine.http_run(
            base_url,
            engine.model_name,
            argparse.Namespace(**{**vars(run), "num_prompts": run.max_concurrency, "warmup": 0}),
            seed_offset=90,
        )
        progress(f"  {run.num_prompts} requests, {run.max_concurrency} in flight")
        result = await bench_engine.http_run(base_url, engine.model_name, run, seed_offset=2)
        if hasattr(engine, "replica_stats"):
            result["replicas"] = [
                {"replica": i, "routed": c.routed, "by_prefix": c.routed_by_prefix, "decoded": s.tokens_decoded}
                for i, _, s, c in engine.replica_stats()
            ]
    return result


def hit_rate(summary: dict[str, Any]) -> float:
    server = summary.get("server_metrics") or {}
    prompt = server.get("prompt_tokens") or 0
    return server.get("cached_prompt_tokens", 0) / prompt if prompt else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", choices=["20b", "120b", "tiny"], default="20b", help="tiny: the tiny random checkpoint (a smoke run)"
    )
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight per replica")
    ap.add_argument("--requests", type=int, default=256, help="requests per replica")
    ap.add_argument("--input-len", type=int, default=256, help="each prompt's own tokens, after the shared prefix")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--shared-prefix-len", type=int, default=1024)
    ap.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="`bench serve`'s client processes, for both runs (one reads several thousand chunks a second)",
    )
    serve_command.add_engine_placement_arguments(ap)  # as oss-agent serve takes them
    ap.set_defaults(max_model_len=4096)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.engine_process is False:
        ap.error("replicas run in engine processes of their own (and so does the one they are compared with)")

    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    argv = ["--ignore-eos", "--no-progress", *serve_command.engine_placement_argv(args)]
    argv += [] if args.model == "tiny" else ["--random-weights", args.model]
    base = parser.parse_args(argv)
    base.engine_process = True  # as serve runs replicas, and the one engine on CUDA
    report: dict[str, Any] = {}
    for replicas in (1, args.replicas):
        run = run_args(base, replicas, args)
        progress(f"gpt-oss-{args.model}, {replicas} replica(s): building")
        start = time.perf_counter()
        engine = bench_engine.build_engine(run)
        progress(f"  ready in {time.perf_counter() - start:.1f} s")
        report[str(replicas)] = bench_engine.run_serving_loop(measure(engine, run))  # its shutdown stops the engine
        summary = report[str(replicas)]
        summary["in_flight"] = run.max_concurrency
        progress(
            f"  {summary['output_throughput']:,.0f} output tok/s, prefix-cache hit rate {hit_rate(summary):.1%}, "
            f"failed {summary['failed']}"
        )
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    one, many = report["1"], report[str(args.replicas)]
    speedup = many["output_throughput"] / one["output_throughput"]
    title = (
        f"gpt-oss-{args.model} random weights, {args.replicas} x {device}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {args.shared_prefix_len} shared + {args.input_len} own prompt "
        f"tokens, {args.output_len} out, {args.concurrency} in flight per replica"
    )
    print()
    for key, summary in report.items():
        print(format_summary(summary, f"{key} replica(s) through HTTP (chat, streaming)"))
        print()
    print(title)
    print()
    print("| replicas | in flight | output tok/s | prefix-cache hit rate | failed |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for key, summary in report.items():
        print(
            f"| {key} | {summary['in_flight']} | {summary['output_throughput']:,.0f} | "
            f"{hit_rate(summary):.1%} | {summary['failed']} |"
        )
    print(
        f"\n**{args.replicas} replicas / 1: {speedup:.2f}x** output throughput; hit rate "
        f"{hit_rate(many):.1%} against {hit_rate(one):.1%}"
    )
    if "replicas" in many:
        print(f"routing: {many['replicas']}")
    if args.json:
        Path(args.json).write_text(json.dumps(json_safe({"title": title, "speedup": speedup, **report}), indent=2))
    return 0 if all(s["failed"] == 0 for s in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
