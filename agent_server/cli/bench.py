"""`oss-agent bench`: serving benchmarks.

    oss-agent bench serve --base-url URL ...   a running server over HTTP (this one or any
                                               OpenAI-compatible one): agent_server/bench/serve.py
    oss-agent bench engine [--model DIR] ...   the engine in-process, optionally against its own
                                               HTTP server in the same run: agent_server/bench/engine.py

Both print the same table (requests, duration, token throughputs, TTFT / TPOT / ITL / end-to-end
latency: mean, median, p90, p99) and write it with `--json PATH`.
"""

from __future__ import annotations

import argparse

from agent_server.bench import engine as bench_engine
from agent_server.bench import serve as bench_serve

BENCHMARKS = {
    "serve": (bench_serve, "benchmark a running server over HTTP (streaming Chat or Responses API)"),
    "engine": (bench_engine, "benchmark the engine in-process, no HTTP (optionally compared with HTTP)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        module.add_arguments(
            subparsers.add_parser(
                name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
            )
        )


def run(args: argparse.Namespace) -> int:
    module, _ = BENCHMARKS[args.benchmark]
    return module.run(args)
