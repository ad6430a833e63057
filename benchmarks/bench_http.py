"""SPEC §3's HTTP targets on full-size random weights: TTFT through HTTP, and the streaming overhead.

Builds gpt-oss-20b (or -120b) with random weights on the GPU, as an engine with the options
`oss-agent serve` uses by default, serves it over loopback HTTP in this process, and runs each
workload twice: straight into the engine (`AsyncEngine.generate`), then through the Chat API
with streaming (`bench serve`), with other prompts of the same shape.

  ttft  a 256-token user message, 1 output token, one request at a time (an idle server). The
        HTTP side's TTFT runs from sending the request to the chunk holding that token's text:
        routing, validation, Harmony rendering, tokenising, queueing, prefill, sampling, the
        Harmony parser and SSE. The engine side's runs from handing it the prompt ids.
  c1    1024-token user messages, 256 output tokens, one at a time.
  c64   the same, 64 in flight.

Streaming overhead = 1 - HTTP output throughput / engine output throughput (SPEC §3: ≤ 5%).
Random weights write no Harmony header, so the server holds their first 48 tokens as a header
and then streams the rest as text (agent_server/harmony.py). Every token still passes through
the Harmony parser, and all but those first 48 through SSE one chunk each, as a real model's do.

    python benchmarks/bench_http.py --model 20b
    python benchmarks/bench_http.py --model 20b --runs ttft --ttft-requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_server import bench_engine  # noqa: E402
from agent_server.bench_report import format_summary, json_safe  # noqa: E402

# name: (user message tokens, output tokens, in flight)
WORKLOADS = {"ttft": (256, 1, 1), "c1": (1024, 256, 1), "c64": (1024, 256, 64)}


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload_args(base: argparse.Namespace, name: str, requests: int) -> argparse.Namespace:
    input_len, output_len, in_flight = WORKLOADS[name]
    return argparse.Namespace(**{**vars(base), "input_len": input_len, "output_len": output_len,
                                 "max_concurrency": in_flight, "num_prompts": requests,
                                 "warmup": max(base.warmup, 1)})


async def measure(engine, runs: dict[str, argparse.Namespace]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    # The HTTP server comes up first and stays: its shutdown also stops the engine.
    async with bench_engine.loopback_server(engine) as base_url:
        for name, args in runs.items():
            progress(f"{name}: {args.num_prompts} requests, {args.input_len} + {args.output_len} tokens, "
                     f"{args.max_concurrency} in flight; the engine alone")
            direct = await bench_engine.engine_run(engine, args)
            progress(f"{name}: the same through HTTP")
            http = await bench_engine.http_run(base_url, engine.model_name, args)
            report[name] = {"engine": direct, "http": http, "http_over_engine": bench_engine.ratios(direct, http)}
    return report


def ms(summary: dict[str, Any], key: str, stat: str) -> str:
    value = summary[key][stat]
    return "n/a" if value is None else f"{value:,.2f}"


def format_report(report: dict[str, Any], title: str) -> str:
    lines = [title, "", "| workload | measure | engine | HTTP | HTTP / engine |", "| --- | --- | ---: | ---: | ---: |"]
    if "ttft" in report:
        r = report["ttft"]
        for stat in ("mean", "median", "p99"):
            e, h = r["engine"]["ttft_ms"][stat], r["http"]["ttft_ms"][stat]
            lines.append(f"| ttft | TTFT {stat} (ms) | {e:,.2f} | {h:,.2f} | {h / e:.3f} |")
        server = r["http"].get("server_metrics") or {}
        if server.get("ttft_mean_ms") is not None:
            lines.append(f"| ttft | server's own TTFT mean, arrival to first token (ms) | | "
                         f"{server['ttft_mean_ms']:,.2f} | |")
        lines.append(f"| ttft | input tokens a request (with the chat template) | "
                     f"{r['engine']['total_input_tokens'] / max(r['engine']['completed'], 1):,.0f} | "
                     f"{r['http']['total_input_tokens'] / max(r['http']['completed'], 1):,.0f} | |")
    for name in ("c1", "c64"):
        if name not in report:
            continue
        r = report[name]
        e, h = r["engine"], r["http"]
        lines.append(f"| {name} | output tok/s | {e['output_throughput']:,.1f} | {h['output_throughput']:,.1f} | "
                     f"{h['output_throughput'] / e['output_throughput']:.3f} |")
        # Not TTFT or TPOT: the HTTP side's first text comes after the 48 tokens held as a header.
        lines.append(f"| {name} | end-to-end latency mean (ms) | {ms(e, 'e2e_ms', 'mean')} | "
                     f"{ms(h, 'e2e_ms', 'mean')} | {h['e2e_ms']['mean'] / e['e2e_ms']['mean']:.3f} |")
        lines.append(f"| {name} | **streaming overhead** (1 - HTTP / engine tok/s) | | "
                     f"**{1 - h['output_throughput'] / e['output_throughput']:.1%}** | |")
    failed = {f"{name} {side}": r[side]["failed"] for name, r in report.items() for side in ("engine", "http")
              if r[side]["failed"]}
    if failed:
        lines.append(f"\nfailed requests: {failed}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["20b", "120b"], default="20b")
    ap.add_argument("--runs", default="ttft,c1,c64", help="workloads to run, comma-separated (ttft, c1, c64)")
    ap.add_argument("--ttft-requests", type=int, default=40)
    ap.add_argument("--c1-requests", type=int, default=8)
    ap.add_argument("--c64-requests", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra keyword for the engine, as in oss-agent serve")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    names = [n for n in args.runs.split(",") if n]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads: {', '.join(sorted(unknown))}")

    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    argv = ["--random-weights", args.model, "--ignore-eos", "--no-progress"]
    argv += [f"--engine-option={o}" for o in args.engine_option]
    if args.device:
        argv += ["--device", args.device]
    if args.temperature is not None:
        argv += ["--temperature", str(args.temperature)]
    base = parser.parse_args(argv)
    requests = {"ttft": args.ttft_requests, "c1": args.c1_requests, "c64": args.c64_requests}
    runs = {name: workload_args(base, name, requests[name]) for name in names}

    progress(f"building the engine: gpt-oss-{args.model} shapes, random weights")
    start = time.perf_counter()
    engine = bench_engine.build_engine(base)
    progress(f"engine ready in {time.perf_counter() - start:.1f} s")
    report = asyncio.run(measure(engine, runs))  # the server's shutdown stops the engine
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    title = (f"gpt-oss-{args.model} random weights on {device}, {time.strftime('%Y-%m-%d %H:%M')}; "
             f"engine options as oss-agent serve's defaults{' + ' + ', '.join(args.engine_option) if args.engine_option else ''}")
    print()
    for name, r in report.items():
        print(format_summary(r["engine"], f"{name}: the engine alone"))
        print()
        print(format_summary(r["http"], f"{name}: through HTTP (chat, streaming)"))
        print()
    print(format_report(report, title))
    if args.json:
        Path(args.json).write_text(json.dumps(json_safe({"title": title, **report}), indent=2))
    ok = all(r[side]["failed"] == 0 and r[side]["completed"] for r in report.values() for side in ("engine", "http"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
