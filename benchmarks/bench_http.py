"""docs/design.md §3's HTTP targets on full-size random weights: TTFT through HTTP, and the streaming overhead.

Builds gpt-oss-20b (or -120b) with random weights on the GPU, as an engine with the options
`oss-agent serve` uses by default (on CUDA in a process of its own, `EngineProcess`;
`--no-engine-process` for the engine thread), serves it over loopback HTTP in this process, and
runs each workload straight into the engine (its `generate`), then through the Chat API with
streaming (`bench serve`, in a process of its own), with other prompts of the same shape.

  ttft  a 256-token user message, 1 output token, one request at a time (an idle server). The
        HTTP side's TTFT runs from sending the request to the chunk holding that token's text:
        routing, validation, Harmony rendering, tokenising, queueing, prefill, sampling, the
        Harmony parser and SSE. The engine side's runs from handing it the prompt ids.
  c1    1024-token user messages, 256 output tokens, one at a time.
  c64   user messages of 128 to 384 tokens, 256 to 768 output tokens (uniform), 64 in flight:
        mostly decode, and requests end at different times, so new ones join a running batch
        one by one. (With equal lengths, 64 requests ended and 64 new ones arrived together; the
        overhead read 4.8% and 18.1% in two rounds of the same code.)
  c128  the same with 128 in flight (not a docs/design.md §3 target; the engine's batch-128 figure is).

Each workload first runs one unmeasured wave (as many requests as it keeps in flight) into the
engine, so that no measured run pays for compiling the kernels of a new batch shape; then
`--rounds` rounds, the engine then HTTP each, so the spread between rounds shows beside the
overhead.
Streaming overhead = 1 - HTTP output throughput / engine output throughput (docs/design.md §3: ≤ 5%).
Random weights write no Harmony header, so the server holds their first 48 tokens as a header
and then streams the rest as text (agent_server/harmony.py). Every token still passes through
the Harmony parser, and all but those first 48 through SSE one chunk each, as a real model's do.

    python benchmarks/bench_http.py --model 20b
    python benchmarks/bench_http.py --model 20b --runs ttft --ttft-requests 100
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

# name: (user message tokens, output tokens, in flight, range ratio of both lengths)
WORKLOADS = {
    "ttft": (256, 1, 1, 0.0),
    "c1": (1024, 256, 1, 0.0),
    "c64": (256, 512, 64, 0.5),
    "c128": (256, 512, 128, 0.5),
}


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload_args(base: argparse.Namespace, name: str, requests: int) -> argparse.Namespace:
    input_len, output_len, in_flight, range_ratio = WORKLOADS[name]
    return argparse.Namespace(
        **{
            **vars(base),
            "input_len": input_len,
            "output_len": output_len,
            "max_concurrency": in_flight,
            "range_ratio": range_ratio,
            "num_prompts": requests,
            "warmup": max(base.warmup, 1),
        }
    )


async def measure(engine, runs: dict[str, argparse.Namespace], rounds: int = 1) -> dict[str, Any]:
    """{workload: [{"engine", "http", "http_over_engine"} for each round]}."""
    report: dict[str, Any] = {name: [] for name in runs}
    # The HTTP server comes up first and stays: its shutdown also stops the engine.
    async with bench_engine.loopback_server(engine) as base_url:
        for w, (name, args) in enumerate(runs.items()):
            # One unmeasured wave at the workload's concurrency first: a batch shape's first step
            # compiles kernels (seconds), which the one-at-a-time warm-up requests never reach.
            # (Measured: the first 64-stream round gave 5,488 tok/s, the next 8,723.)
            progress(f"{name}: a warm-up wave of {args.max_concurrency} requests, not measured")
            await bench_engine.engine_run(
                engine,
                argparse.Namespace(**{**vars(args), "num_prompts": args.max_concurrency, "warmup": 0}),
                seed_offset=100 * w + 90,
            )
            for r in range(rounds):
                progress(
                    f"{name}, round {r + 1}: {args.num_prompts} requests, {args.input_len} + "
                    f"{args.output_len} tokens, {args.max_concurrency} in flight; the engine alone"
                )
                # Prompts of their own for each workload, round and side (and their warm-ups, at
                # +1): none gets prefix-cache hits from another's, beyond the chat template.
                seed = 100 * w + 10 * r
                direct = await bench_engine.engine_run(engine, args, seed_offset=seed)
                progress(f"{name}, round {r + 1}: the same through HTTP")
                http = await bench_engine.http_run(base_url, engine.model_name, args, seed_offset=seed + 2)
                report[name].append(
                    {"engine": direct, "http": http, "http_over_engine": bench_engine.ratios(direct, http)}
                )
    return report


def ms(summary: dict[str, Any], key: str, stat: str) -> str:
    value = summary[key][stat]
    return "n/a" if value is None else f"{value:,.2f}"


def format_report(report: dict[str, Any], title: str) -> str:
    lines = [
        title,
        "",
        "| workload | round | measure | engine | HTTP | HTTP / engine |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r, run in enumerate(report.get("ttft", []), 1):
        for stat in ("mean", "median", "p99"):
            e, h = run["engine"]["ttft_ms"][stat], run["http"]["ttft_ms"][stat]
            lines.append(f"| ttft | {r} | TTFT {stat} (ms) | {e:,.2f} | {h:,.2f} | {h / e:.3f} |")
        server = run["http"].get("server_metrics") or {}
        if server.get("ttft_mean_ms") is not None:
            lines.append(
                f"| ttft | {r} | server's own TTFT mean, arrival to first token (ms) | | "
                f"{server['ttft_mean_ms']:,.2f} | |"
            )
        lines.append(
            f"| ttft | {r} | input tokens a request (with the chat template) | "
            f"{run['engine']['total_input_tokens'] / max(run['engine']['completed'], 1):,.0f} | "
            f"{run['http']['total_input_tokens'] / max(run['http']['completed'], 1):,.0f} | |"
        )
    for name in ("c1", "c64", "c128"):
        overheads = []
        for r, run in enumerate(report.get(name, []), 1):
            e, h = run["engine"], run["http"]
            overheads.append(1 - h["output_throughput"] / e["output_throughput"])
            lines.append(
                f"| {name} | {r} | output tok/s | {e['output_throughput']:,.1f} | "
                f"{h['output_throughput']:,.1f} | {h['output_throughput'] / e['output_throughput']:.3f} |"
            )
            # Not TTFT or TPOT: the HTTP side's first text comes after the 48 tokens held as a header.
            lines.append(
                f"| {name} | {r} | end-to-end latency mean (ms) | {ms(e, 'e2e_ms', 'mean')} | "
                f"{ms(h, 'e2e_ms', 'mean')} | {h['e2e_ms']['mean'] / e['e2e_ms']['mean']:.3f} |"
            )
        if overheads:
            lines.append(
                f"| {name} | all | **streaming overhead** (1 - HTTP / engine tok/s) | | "
                f"**{sum(overheads) / len(overheads):.1%}** (rounds: "
                f"{', '.join(f'{o:.1%}' for o in overheads)}) | |"
            )
    failed = {
        f"{name} round {r} {side}": run[side]["failed"]
        for name, runs in report.items()
        for r, run in enumerate(runs, 1)
        for side in ("engine", "http")
        if run[side]["failed"]
    }
    if failed:
        lines.append(f"\nfailed requests: {failed}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["20b", "120b"], default="20b")
    ap.add_argument("--runs", default="ttft,c1,c64", help="workloads to run, comma-separated (ttft, c1, c64, c128)")
    ap.add_argument("--ttft-requests", type=int, default=40)
    ap.add_argument("--c1-requests", type=int, default=8)
    ap.add_argument("--c64-requests", type=int, default=256)
    ap.add_argument("--c128-requests", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="engine-then-HTTP rounds of each workload")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    serve_command.add_engine_placement_arguments(ap)  # as oss-agent serve takes them
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    names = [n for n in args.runs.split(",") if n]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads: {', '.join(sorted(unknown))}")

    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    argv = ["--random-weights", args.model, "--ignore-eos", "--no-progress"]
    argv += serve_command.engine_placement_argv(args)
    if args.temperature is not None:
        argv += ["--temperature", str(args.temperature)]
    base = parser.parse_args(argv)
    requests = {
        "ttft": args.ttft_requests,
        "c1": args.c1_requests,
        "c64": args.c64_requests,
        "c128": args.c128_requests,
    }
    runs = {name: workload_args(base, name, requests[name]) for name in names}

    progress(f"building the engine: gpt-oss-{args.model} shapes, random weights")
    start = time.perf_counter()
    engine = bench_engine.build_engine(base)
    from inference.engine.process import EngineProcess

    where = "a process of its own" if isinstance(engine, EngineProcess) else "a thread of this process"
    progress(f"engine ready in {time.perf_counter() - start:.1f} s, running in {where}")
    report = bench_engine.run_serving_loop(measure(engine, runs, args.rounds))  # its server's shutdown stops the engine
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    extra = f" + {', '.join(args.engine_option)}" if args.engine_option else ""
    title = (
        f"gpt-oss-{args.model} random weights on {device}, {time.strftime('%Y-%m-%d %H:%M')}; "
        f"engine options as oss-agent serve's defaults{extra}; the engine in {where}"
    )
    print()
    for name, runs_of in report.items():
        for r, run in enumerate(runs_of, 1):
            print(format_summary(run["engine"], f"{name}, round {r}: the engine alone"))
            print()
            print(format_summary(run["http"], f"{name}, round {r}: through HTTP (chat, streaming)"))
            print()
    print(format_report(report, title))
    if args.json:
        Path(args.json).write_text(json.dumps(json_safe({"title": title, **report}), indent=2))
    ok = all(
        run[side]["failed"] == 0 and run[side]["completed"]
        for runs_of in report.values()
        for run in runs_of
        for side in ("engine", "http")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
