"""`oss-agent bench engine`: the same benchmark in-process, on the engine alone (no HTTP).

Each request is the prompt the server would build for a Chat Completions request with that
user message (the Harmony system message and template included, so input token counts match
the server's), streamed through the engine client's `generate`, built as `oss-agent serve` builds
it (on CUDA in a process of its own: `--no-engine-process` for the thread); TTFT is to the first
generated token.
With no `--model` it runs the tiny random checkpoint on CPU (numbers are for trying it out).

`--compare-http` then serves the same engine over HTTP on a loopback port, in this process,
and runs `bench serve` (Chat API) in a process of its own with prompts of the same shape, so the
cost of HTTP, SSE and Harmony parsing shows as a ratio measured in one run. The HTTP side times the first streamed
*text*, which the model writes after its Harmony header (`<|channel|>final<|message|>`, a few
tokens); use `--ignore-eos` so both sides generate the same number of tokens.

    oss-agent bench engine --model /models/gpt-oss-20b --num-prompts 256 --input-len 1024 \\
        --output-len 256 --max-concurrency 64 --ignore-eos --compare-http
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from agent_server.bench.driver import add_load_arguments, check_load_arguments, drive
from agent_server.bench.report import (
    RequestResult,
    engine_steps,
    format_engine_steps,
    format_summary,
    json_safe,
    summarize,
)
from agent_server.bench.serve import add_target_arguments
from agent_server.bench.workload import BenchRequest, add_workload_arguments, workload_from_args
from agent_server.cli import serve as serve_command
from inference.config import GPT_OSS_SHAPES

T = TypeVar("T")

COMPARED = (
    ("output token throughput (tok/s)", lambda s: s["output_throughput"]),
    ("request throughput (req/s)", lambda s: s["request_throughput"]),
    ("mean TTFT (ms)", lambda s: s["ttft_ms"]["mean"]),
    ("mean TPOT (ms)", lambda s: s["tpot_ms"]["mean"]),
    ("median ITL (ms)", lambda s: s["itl_ms"]["median"]),
    ("mean end-to-end latency (ms)", lambda s: s["e2e_ms"]["mean"]),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--model", help="HF gpt-oss checkpoint directory (default: a tiny random one)")
    weights.add_argument(
        "--random-weights",
        choices=sorted(GPT_OSS_SHAPES),
        metavar="SHAPES",
        help="instead, the full-size shapes of gpt-oss-SHAPES (20b or 120b) with random weights "
        "made on the device: speed without a checkpoint (the text is random)",
    )
    serve_command.add_engine_placement_arguments(parser)  # --device, --max-model-len, --engine-option/-process
    add_target_arguments(parser)
    parser.add_argument(
        "--compare-http",
        action="store_true",
        help="also serve this engine over loopback HTTP and report HTTP / engine ratios",
    )
    add_workload_arguments(parser)
    add_load_arguments(parser)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options `oss-agent serve` would build from the same flags (its defaults for
    the serve flags this command does not have), so the engine benchmarked is the one served."""
    serve_parser = argparse.ArgumentParser()
    serve_command.add_arguments(serve_parser)
    merged = {**vars(serve_parser.parse_args([])), **vars(args)}
    return serve_command.engine_options(argparse.Namespace(**merged))


def server_prompt(text: str) -> list[int]:
    """The token ids the server generates from for a Chat request whose only message is `text`."""
    from agent_server.chat.prompt import chat_prompt
    from schemas.chat import ChatCompletionRequest

    return chat_prompt(ChatCompletionRequest(model="bench", messages=[{"role": "user", "content": text}]))


class EngineBench:
    """Sends workload requests straight to an `AsyncEngine` and times their token streams."""

    def __init__(self, engine, *, ignore_eos: bool = False, temperature: float | None = None):
        self.engine = engine
        self.ignore_eos = ignore_eos
        self.temperature = 1.0 if temperature is None else temperature  # the server's default too
        self.ids = itertools.count()

    async def send(self, req: BenchRequest) -> RequestResult:
        from inference.request import GenerationRequest, SamplingParams
        from inference.tokenizer import ASSISTANT_STOP_TOKENS

        result = RequestResult(req.prompt_len, req.output_len, output_counted_by="engine")
        sampling = SamplingParams(
            temperature=self.temperature,
            max_tokens=req.output_len,
            stop_token_ids=[] if self.ignore_eos else list(ASSISTANT_STOP_TOKENS),
        )
        request = GenerationRequest(f"bench-{next(self.ids)}", server_prompt(req.prompt), sampling)
        result.start = time.perf_counter()
        try:
            async for delta in self.engine.generate(request):
                now = time.perf_counter()
                result.input_tokens = delta.num_prompt_tokens
                if delta.token_ids:
                    if result.ttft is None:
                        result.ttft = now - result.start
                    result.delta_times.append(now)
                    result.output_tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    result.finish_reason = delta.finish_reason
                    if delta.finish_reason not in ("stop", "length"):
                        result.error = delta.error or f"finished with {delta.finish_reason}"
        except ValueError as e:  # the engine refused the request (too long, ...)
            result.error = str(e)
        result.e2e = time.perf_counter() - result.start
        result.ok = result.error is None and result.finish_reason is not None
        return result


async def _warm_up(send, requests: list[BenchRequest]) -> None:
    for req in requests:
        result = await send(req)
        if not result.ok:
            raise RuntimeError(f"the warm-up request failed: {result.error}")


@contextlib.asynccontextmanager
async def loopback_server(engine) -> AsyncIterator[str]:
    """Serve `engine` on 127.0.0.1 (a free port) in this event loop; yields the base URL. The
    app's shutdown also shuts the engine down, so nothing may use the engine after this; when
    the app cannot be made, the engine is shut down here (its process would outlive the run)."""
    try:
        import uvicorn

        from agent_server.app import create_app
        from agent_server.state import ServerConfig
    except BaseException:
        await engine.shutdown()
        raise

    with tempfile.TemporaryDirectory(prefix="oss-agent-bench-") as scratch:
        config = ServerConfig(model_name=engine.model_name, store_path=Path(scratch) / "responses.sqlite3")
        app = create_app(config, lambda: engine)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                if serving.done():
                    serving.result()
                    raise RuntimeError("the HTTP server did not start")
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            while not app.state.server.ready:
                if app.state.server.extra.get("load_error"):
                    raise RuntimeError(f"the HTTP server failed to start: {app.state.server.extra['load_error']}")
                await asyncio.sleep(0.01)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await serving


def run_serving_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the event loop `oss-agent serve` gets: uvicorn runs uvloop when it is
    installed, so the loopback server measured here runs on the loop users' servers run on."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def engine_run(engine, args: argparse.Namespace, *, seed_offset: int = 0) -> dict[str, Any]:
    """The workload of `args` straight into the engine (after its warm-up requests): the summary."""
    bench = EngineBench(engine, ignore_eos=args.ignore_eos, temperature=args.temperature)
    await _warm_up(
        bench.send, workload_from_args(args, num=args.warmup, seed_offset=seed_offset + 1) if args.warmup else []
    )
    stats_before = engine.stats()
    results, start, duration = await drive(
        workload_from_args(args, seed_offset=seed_offset),
        bench.send,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        progress=not args.no_progress,
        desc="bench engine",
    )
    stats = engine.stats()
    summary = summarize(
        results,
        duration,
        start,
        backend="engine",
        model=engine.model_name,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        prefix_hit_tokens=stats.prefix_hit_tokens - stats_before.prefix_hit_tokens,
        preemptions=stats.preemptions - stats_before.preemptions,
    )
    summary["engine_steps"] = engine_steps(stats.step_times - stats_before.step_times, duration)
    return summary


async def http_run(base_url: str, model: str, args: argparse.Namespace, *, seed_offset: int = 2) -> dict[str, Any]:
    """The same shape of workload through the Chat API of the server at `base_url`: `bench serve`
    in a process of its own, so that its reading of the streams (SSE, JSON) does not take this
    process's GIL from the engine thread and count as the server's cost. Other prompts than
    `engine_run`'s (seed + `seed_offset`), so neither run gets prefix-cache hits from the other's."""
    with tempfile.TemporaryDirectory(prefix="oss-agent-bench-") as scratch:
        out = Path(scratch) / "serve.json"
        argv = [
            sys.executable,
            "-m",
            "agent_server.cli",
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--model",
            model,
            "--api",
            "chat",
            "--server-metrics",
            "--no-progress",
            "--json",
            str(out),
            "--seed",
            str(args.seed + seed_offset),
            "--num-prompts",
            str(args.num_prompts),
            "--input-len",
            str(args.input_len),
            "--range-ratio",
            str(args.range_ratio),
            "--request-rate",
            str(args.request_rate),
            "--burstiness",
            str(args.burstiness),
            "--warmup",
            str(args.warmup),
        ]
        for flag, value in (
            ("--output-len", args.output_len),
            ("--dataset", args.dataset),
            ("--max-concurrency", args.max_concurrency),
            ("--temperature", args.temperature),
            ("--shared-prefix-len", getattr(args, "shared_prefix_len", 0) or None),
            ("--client-processes", getattr(args, "client_processes", None)),
        ):
            if value is not None:
                argv += [flag, str(value)]
        if args.ignore_eos:
            argv.append("--ignore-eos")
        client = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, err = await client.communicate()
        if not out.exists():
            raise RuntimeError(f"bench serve failed (exit {client.returncode}): {err.decode()[-2000:]}")
        return json.loads(out.read_text())


def ratios(engine: dict[str, Any], http: dict[str, Any]) -> dict[str, float]:
    """HTTP / engine for each of COMPARED."""

    def ratio(h: float | None, e: float | None) -> float:  # None: a JSON summary's n/a
        return h / e if h is not None and e else math.nan

    return {name: ratio(value(http), value(engine)) for name, value in COMPARED}


async def benchmark(engine, args: argparse.Namespace) -> dict[str, Any]:
    """The engine run, then (with --compare-http) the HTTP run; returns {"engine": summary,
    "http": summary, "http_over_engine": ratios} (the last two with --compare-http only)."""
    report: dict[str, Any] = {"engine": await engine_run(engine, args)}
    if args.compare_http:
        async with loopback_server(engine) as base_url:
            report["http"] = await http_run(base_url, engine.model_name, args)
        report["http_over_engine"] = ratios(report["engine"], report["http"])
    return report


def format_comparison(report: dict[str, Any]) -> str:
    engine, http, ratios = report["engine"], report["http"], report["http_over_engine"]
    lines = [
        "HTTP (chat, streaming) vs the engine alone, same workload shape",
        "",
        "| measure | engine | HTTP | HTTP / engine |",
        "| --- | ---: | ---: | ---: |",
    ]

    def cell(v: float | None, spec: str) -> str:
        return "n/a" if v is None or math.isnan(v) else format(v, spec)

    for name, value in COMPARED:
        lines.append(
            f"| {name} | {cell(value(engine), ',.2f')} | {cell(value(http), ',.2f')} | {cell(ratios[name], '.3f')} |"
        )
    overhead = 1 - ratios["output token throughput (tok/s)"]
    lines.append(f"\nstreaming overhead (1 - HTTP / engine output throughput): {overhead:.1%}")
    return "\n".join(lines)


def build_engine(args: argparse.Namespace):
    """The engine client the arguments describe, built as `oss-agent serve` builds it: its engine
    options, and in a process of its own where serve would run it so (`--engine-process`)."""
    from inference.engine.process import EngineSpec, start_engine_client

    options = {"device": args.device, **engine_options(args)}
    own_process = serve_command.engine_in_process_of_its_own(args)
    if args.random_weights:
        from inference.model.tiny_checkpoint import hf_config_dict

        print(
            f"gpt-oss-{args.random_weights} shapes with random weights, made on the device"
            f"{', in an engine process' if own_process else ''}",
            file=sys.stderr,
        )
        spec = EngineSpec(
            random_config=hf_config_dict(GPT_OSS_SHAPES[args.random_weights]),
            model_name=f"gpt-oss-{args.random_weights}-random",
            options=options,
        )
    else:
        if args.model:
            model_dir = Path(args.model)
        else:
            from inference.model.tiny_checkpoint import default_tiny_checkpoint

            model_dir = default_tiny_checkpoint()
            print(f"no --model: benchmarking a tiny random-weight checkpoint ({model_dir})", file=sys.stderr)
        spec = EngineSpec(model_dir=str(model_dir), options=options)
    replicas = getattr(args, "data_parallel_size", 1) or 1
    if replicas > 1:  # as `oss-agent serve --data-parallel-size N`
        from inference.engine.replicas import start_replicas

        return start_replicas(spec, replicas)
    return start_engine_client(spec, own_process)


def run(args: argparse.Namespace) -> int:
    check_load_arguments(args)
    engine = build_engine(args)

    async def measure() -> dict[str, Any]:
        try:
            return await benchmark(engine, args)
        finally:
            await engine.shutdown()  # a no-op when --compare-http's server already shut it down

    try:
        report = run_serving_loop(measure())
    except RuntimeError as e:
        print(f"bench engine: {e}", file=sys.stderr)
        return 1
    print(format_summary(report["engine"], f"engine benchmark: {engine.model_name}, in-process"))
    print()
    print(format_engine_steps(report["engine"]["engine_steps"]))
    if "http" in report:
        print()
        print(format_summary(report["http"], f"the same engine over HTTP: {report['http']['base_url']}"))
        print()
        print(format_comparison(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_safe(report), f, indent=2)
    return 0 if report["engine"]["completed"] else 1
