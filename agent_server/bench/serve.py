"""`oss-agent bench serve`: load a running server over HTTP and measure what its users see.

Works against this server or any OpenAI-compatible one. Each request streams, through Chat
Completions (`--api chat`, the default) or the Responses API (`--api responses`), and is timed
from the moment it is sent: time to first token, time per output token, inter-token latency,
end-to-end latency, token throughputs (see agent_server/bench/report.py for the definitions).

    oss-agent bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --input-len 1024 \\
        --output-len 256 --max-concurrency 32 --ignore-eos --json results.json

Token counts: prompt lengths are o200k tokens of the text sent (the server adds its chat
template; its `usage` input tokens include that). Output tokens are what the server reports
in `usage` (Chat: `stream_options.include_usage`; Responses: the final event's response); a
server that reports none has its streamed text counted with o200k instead, and the table says
which was used. To get exactly `--output-len` tokens the model must not stop early:
`--ignore-eos` sends `ignore_eos: true` (a Chat Completions extension this server, vLLM and
SGLang accept). TTFT is to the first streamed text: gpt-oss writes a Harmony header of a few
tokens first (the tiny random model's noise is held back as a would-be header for up to 48
tokens, so there TTFT is late and TPOT small; ITL still shows the decode speed).

A stream counts as successful only if it is well formed: Chat ends with a finish_reason and
`[DONE]`; Responses starts with response.created, numbers its events 0, 1, 2, ... and ends
with response.completed or response.incomplete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import queue
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from agent_server.bench.driver import add_load_arguments, check_load_arguments, drive
from agent_server.bench.report import RequestResult, format_summary, json_safe, summarize
from agent_server.bench.workload import BenchRequest, add_workload_arguments, workload_from_args

RESPONSES_END = {"response.completed", "response.incomplete", "response.failed"}


@dataclass
class ServeTarget:
    """Where and how to send the benchmark's requests."""

    base_url: str  # http://host:port, without /v1
    model: str
    api: str = "chat"  # "chat" or "responses"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    timeout: float = 600.0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request(self, req: BenchRequest) -> tuple[str, dict[str, Any]]:
        """(URL, JSON body) of one streaming request."""
        if self.api == "chat":
            body: dict[str, Any] = {
                "model": self.model,
                "messages": [{"role": "user", "content": req.prompt}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": req.output_len,
            }
            if self.ignore_eos:
                body["ignore_eos"] = True
            url = f"{self.base_url}/v1/chat/completions"
        else:
            body = {
                "model": self.model,
                "input": req.prompt,
                "stream": True,
                "store": False,
                "max_output_tokens": req.output_len,
            }
            url = f"{self.base_url}/v1/responses"
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return url, {**body, **self.extra_body}


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# --- one request ----------------------------------------------------------------------------


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(response: httpx.Response):
    """The stream's lines, ended as the SSE format ends them: CRLF, LF or CR. Not httpx's
    `aiter_lines`, which also splits at U+2028, U+0085 and the like, which JSON may carry raw."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        # A CR at the end may be the first half of a CRLF: keep it for the next piece.
        cut = len(pending) - 1 if pending.endswith("\r") else len(pending)
        *lines, rest = _SSE_LINE_END.split(pending[:cut])
        pending = rest + pending[cut:]
        for line in lines:
            yield line
    *lines, rest = _SSE_LINE_END.split(pending)
    for line in lines:
        yield line
    if rest:
        yield rest


async def sse_events(response: httpx.Response):
    """The `data:` payloads of a server-sent event stream, one string per event."""
    data: list[str] = []
    async for line in sse_lines(response):
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        # "event:", "id:", "retry:" and ":" comments (keep-alive pings) carry nothing we time
    if data:
        yield "\n".join(data)


class StreamCheck:
    """Reads one stream's events: output deltas (timed), usage, and whether it is well formed."""

    def __init__(self, api: str, result: RequestResult):
        self.api = api
        self.result = result
        self.done = False  # Chat: [DONE] seen; Responses: a terminal event seen
        self.problem: str | None = None  # why the stream is not well formed
        self.next_sequence = 0

    def fail(self, problem: str) -> None:
        self.problem = self.problem or problem  # the first problem is the one to report

    def output(self, text: str, now: float) -> None:
        if not text:
            return
        r = self.result
        if r.ttft is None:
            r.ttft = now - r.start
        r.delta_times.append(now)
        r.text += text

    def feed(self, data: str, now: float) -> None:
        if self.done:
            self.fail("data after the end of the stream")
            return
        if self.api == "chat" and data == "[DONE]":
            self.done = True
            if self.result.finish_reason is None:
                self.fail("the stream ended without a finish_reason")
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.fail(f"an event is not JSON: {data[:80]!r}")
            return
        if self.api == "chat":
            self._chat(event, now)
        else:
            self._responses(event, now)

    def _chat(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            error = chunk["error"]
            self.fail(f"error in stream: {error.get('message') if isinstance(error, dict) else error}")
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
            for call in delta.get("tool_calls") or []:
                text += (call.get("function") or {}).get("arguments") or ""
            self.output(text, now)
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            self.result.input_tokens = usage.get("prompt_tokens")
            self.result.output_tokens = usage.get("completion_tokens") or 0

    def _responses(self, event: dict[str, Any], now: float) -> None:
        kind = event.get("type", "")
        sequence = event.get("sequence_number")
        if sequence is not None:
            if sequence != self.next_sequence:
                self.fail(f"event {sequence} arrived where {self.next_sequence} was due")
            self.next_sequence = sequence + 1
        if self.next_sequence == 1 and kind != "response.created":
            self.fail(f"the stream starts with {kind}, not response.created")
        if kind == "response.created":
            self.result.response_id = (event.get("response") or {}).get("id")
        elif kind.endswith(".delta") and isinstance(event.get("delta"), str):
            self.output(event["delta"], now)
        elif kind == "error":
            self.fail(f"error in stream: {event.get('message')}")
        if kind in RESPONSES_END:
            self.done = True
            response = event.get("response") or {}
            self.result.finish_reason = response.get("status")
            usage = response.get("usage") or {}
            if usage:
                self.result.input_tokens = usage.get("input_tokens")
                self.result.output_tokens = usage.get("output_tokens") or 0
            if kind == "response.failed":
                self.fail(f"response failed: {(response.get('error') or {}).get('message', 'no reason given')}")

    def finish(self, now: float) -> RequestResult:
        r = self.result
        r.e2e = now - r.start
        if not self.done:
            self.fail("the stream ended early")
        r.ok = self.problem is None
        r.error = self.problem
        if r.ok and r.output_tokens == 0 and r.text:  # no usage reported: count what streamed
            from inference.tokenizer import encode_text

            r.output_tokens, r.output_counted_by = len(encode_text(r.text)), "o200k"
        return r


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error") or {}
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (json.JSONDecodeError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}"


async def send_request(client: httpx.AsyncClient, target: ServeTarget, req: BenchRequest) -> RequestResult:
    """Send one streaming request and time it; never raises for server-side trouble."""
    url, body = target.request(req)
    result = RequestResult(req.prompt_len, req.output_len)
    check = StreamCheck(target.api, result)
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=target.headers(), timeout=target.timeout) as response:
            if response.status_code != 200:
                result.error = _error_message(response.status_code, await response.aread())
                result.e2e = time.perf_counter() - result.start
                return result
            async for data in sse_events(response):
                check.feed(data, time.perf_counter())
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if isinstance(e, httpx.TransportError):  # (httpx's "All connection attempts failed" names no address)
            result.error += f" ({url})"
        result.e2e = time.perf_counter() - result.start
        return result
    return check.finish(time.perf_counter())


# --- the load, split over client processes -------------------------------------------------


@dataclass(frozen=True)
class Load:
    """How requests are sent (`drive`'s arguments)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def share(self, index: int, parts: int) -> Load:
        """Process `index` of `parts`: its part of the rate and of the concurrency (the first
        processes take one more where it does not divide), and arrivals of its own. Independent
        Poisson arrivals at R / parts add up to Poisson arrivals at R."""
        concurrency = None
        if self.max_concurrency is not None:
            concurrency = self.max_concurrency // parts + (index < self.max_concurrency % parts)
        return Load(self.request_rate / parts, self.burstiness, concurrency, self.seed + 1000 * index)


async def drive_in_processes(
    target: ServeTarget, requests: list[BenchRequest], load: Load, processes: int
) -> tuple[list[RequestResult], float, float]:
    """`drive`, with the requests dealt out to `processes` client processes: one process's event
    loop reads several thousand streamed chunks a second (httpx, SSE, JSON), less than a server
    with several engine replicas sends (docs/benchmark-log.md, "Data parallelism on 2 H200s").
    Every process connects first; they start together; times are `time.perf_counter`, one
    clock for all processes (CLOCK_MONOTONIC on Linux). Returns (results in request order,
    start, duration), as `drive` does."""
    import multiprocessing as mp

    processes = max(1, min(processes, len(requests), load.max_concurrency or len(requests)))
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(
            target=_client_process,
            args=(i, target, requests[i::processes], load.share(i, processes), go, results),
            daemon=True,
        )
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    loop = asyncio.get_running_loop()

    def next_message():  # a process that died without a word (killed) must not leave us waiting
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
                if dead:
                    return ("failed", dead[0], f"exited with {workers[dead[0]].exitcode}")

    try:
        for _ in workers:
            kind, index, payload = await loop.run_in_executor(None, next_message)
            if kind == "failed":
                raise RuntimeError(f"client process {index} could not start: {payload}")
        go.set()
        parts = {}
        for _ in workers:
            kind, index, payload = await loop.run_in_executor(None, next_message)
            if kind == "failed":
                raise RuntimeError(f"client process {index} failed: {payload}")
            parts[index] = payload
    finally:
        go.set()
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    start = min(part[1] for part in parts.values())
    end = max(part[1] + part[2] for part in parts.values())
    ordered: list[RequestResult] = [None] * len(requests)  # type: ignore[list-item]
    for index, (part, _, _) in parts.items():
        ordered[index::processes] = part
    return ordered, start, end - start


def _client_process(index: int, target: ServeTarget, requests, load: Load, go, results) -> None:
    """One client process of `drive_in_processes`: connect, say ready, wait for go, drive."""

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=load.max_concurrency or len(requests))
        async with httpx.AsyncClient(limits=limits, timeout=target.timeout, headers=target.headers()) as client:
            await client.get(f"{target.base_url}/v1/models")  # a connection open before the start
            results.put(("ready", index, None))
            await asyncio.to_thread(go.wait)
            return await drive(
                requests,
                lambda req: send_request(client, target, req),
                request_rate=load.request_rate,
                burstiness=load.burstiness,
                max_concurrency=load.max_concurrency,
                seed=load.seed,
                progress=False,
            )

    try:
        results.put(("done", index, asyncio.run(main())))
    except BaseException as e:  # the parent is told either way, never left waiting
        results.put(("failed", index, f"{type(e).__name__}: {e}"))


# --- the benchmark --------------------------------------------------------------------------


async def served_model(client: httpx.AsyncClient, target: ServeTarget) -> str:
    response = await client.get(f"{target.base_url}/v1/models", headers=target.headers())
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{target.base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def benchmark(
    target: ServeTarget,
    requests: list[BenchRequest],
    *,
    warmup: list[BenchRequest] = (),
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
    server_metrics: bool = False,
    client_processes: int = 1,
) -> dict[str, Any]:
    """Run the workload against `target` and return the summary (bench_report.summarize), with
    the warm-up requests sent first, one at a time, and left out. `client_processes` > 1: the
    requests are sent and read by that many processes (`drive_in_processes`)."""
    from agent_server.bench.server_metrics import server_view, settled_scrape

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or len(requests))
    # (the key goes with every request, the /metrics scrapes included)
    async with httpx.AsyncClient(limits=limits, timeout=target.timeout, headers=target.headers()) as client:
        if not target.model:
            target.model = await served_model(client, target)
        for req in warmup:
            result = await send_request(client, target, req)
            if not result.ok:
                raise RuntimeError(f"the warm-up request failed: {result.error}")
        before = await settled_scrape(client, target.base_url) if server_metrics else None
        load = Load(request_rate, burstiness, max_concurrency, seed)
        if client_processes > 1:
            results, start, duration = await drive_in_processes(target, requests, load, client_processes)
        else:
            results, start, duration = await drive(
                requests,
                lambda req: send_request(client, target, req),
                request_rate=request_rate,
                burstiness=burstiness,
                max_concurrency=max_concurrency,
                seed=seed,
                progress=progress,
                desc=f"bench serve ({target.api})",
            )
        after = await settled_scrape(client, target.base_url) if server_metrics else None
    summary = summarize(
        results,
        duration,
        start,
        backend=f"http-{target.api}",
        base_url=target.base_url,
        model=target.model,
        request_rate=request_rate,
        burstiness=burstiness,
        max_concurrency=max_concurrency,
        ignore_eos=target.ignore_eos,
    )
    if server_metrics:
        summary["server_metrics"] = server_view(before, after, target.api)
    return summary


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly the output length, past the model's end of turn (Chat "
        "Completions extension `ignore_eos`)",
    )
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    parser.add_argument("--api", choices=["chat", "responses"], default="chat")
    parser.add_argument("--model", default=None, help="model id to request (default: the first of /v1/models)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OSS_AGENT_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OSS_AGENT_API_KEY or $OPENAI_API_KEY)",
    )
    add_target_arguments(parser)
    parser.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        metavar="JSON",
        help='fields merged into every request body, e.g. \'{"reasoning_effort": "low"}\'',
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument(
        "--server-metrics",
        action="store_true",
        help="scrape the server's GET /metrics before and after and report its own numbers",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="send and read the requests from this many processes (one reads several thousand "
        "streamed chunks a second; the rate and concurrency are shared out)",
    )
    add_workload_arguments(parser)
    add_load_arguments(parser)


def run(args: argparse.Namespace) -> int:
    check_load_arguments(args)
    if args.ignore_eos and args.api != "chat":
        raise SystemExit("--ignore-eos is a Chat Completions extension: use it with --api chat")
    if not isinstance(args.extra_body, dict):
        raise SystemExit("--extra-body must be a JSON object")
    if args.client_processes < 1:
        raise SystemExit("--client-processes must be >= 1")
    target = ServeTarget(
        base_url=normalize_base_url(args.base_url),
        model=args.model or "",
        api=args.api,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        timeout=args.timeout,
    )
    requests = workload_from_args(args)
    warmup = workload_from_args(args, num=args.warmup, seed_offset=1) if args.warmup else []
    try:
        summary = asyncio.run(
            benchmark(
                target,
                requests,
                warmup=warmup,
                request_rate=args.request_rate,
                burstiness=args.burstiness,
                max_concurrency=args.max_concurrency,
                seed=args.seed,
                progress=not args.no_progress,
                server_metrics=args.server_metrics,
                client_processes=args.client_processes,
            )
        )
    except httpx.TransportError as e:
        print(
            f"bench serve: cannot reach {target.base_url}: {e or type(e).__name__} (is the server running? "
            "--base-url says where it is)",
            file=sys.stderr,
        )
        return 1
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary, f"serving benchmark: {target.api} API at {target.base_url}, model {target.model}"))
    if args.server_metrics:
        from agent_server.bench.server_metrics import format_server_view

        print()
        print(format_server_view(summary["server_metrics"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_safe(summary), f, indent=2)
    return 0 if summary["completed"] else 1
