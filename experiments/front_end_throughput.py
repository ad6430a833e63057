"""How many streamed tokens a second one HTTP server process delivers, with no GPU.

An engine stand-in (`PacedEngine`) gives every running stream one token per step, all of them
at once, as the engine process does at the end of a decode step; `step-ms` paces the steps,
which never wait for the server (steps the server's loop came too late for are delivered
together, as the engine process's passes are read from its pipe). The server (the real app, on
loopback, in this process) streams them through the Chat API to `oss-agent bench serve` in
processes of its own. Offered = concurrency / step; when delivered falls short of offered, the
server's event loop (or the client: see its CPU) is the limit, not the engine. The server's CPU
a delivered token is the figure to compare between trees on a machine where the client is the
limit. Results: docs/benchmark-log.md, "Data parallelism on 2 H200s".

    python experiments/front_end_throughput.py --concurrency 128 --step-ms 8 --client-processes 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_server.bench import engine as bench_engine  # noqa: E402
from inference.engine.client import StreamingEngineClient  # noqa: E402
from inference.request import EngineStats, GenerationRequest, TokenDelta  # noqa: E402
from inference.tokenizer import harmony_encoding  # noqa: E402


class PacedEngine(StreamingEngineClient):
    """Every open stream gets its next token at each step, every `step_s` seconds, through the
    same queues and streams (`inference/engine/client.py`) as the engine process's deltas; the
    next step does not wait for the server, as a real engine's does not."""

    model_name = "paced"
    max_model_len = 1 << 20
    vocab_size = 201088

    def __init__(self, step_s: float):
        super().__init__()
        self.step_s = step_s
        text = "<|channel|>final<|message|>" + "a word or two " * 3000
        self.body = harmony_encoding().encode(text, allowed_special="all")
        self.open: dict[str, tuple[asyncio.Queue, GenerationRequest, list[int]]] = {}
        self.ticker: asyncio.Task | None = None
        self._stats = EngineStats(pages_total=1024)

    def _check_serving(self) -> None:
        pass

    def _open(self, request: GenerationRequest, queue: asyncio.Queue) -> None:
        if self.ticker is None:
            self.ticker = asyncio.create_task(self._tick())
        self.open[request.request_id] = (queue, request, [0])

    def _submit(self, command: tuple) -> None:
        if command[0] == "abort" and command[1] in self.open:
            queue, _, _ = self.open.pop(command[1])
            queue.put_nowait(TokenDelta(command[1], [], finish_reason="abort"))

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            next_step += self.step_s
            await asyncio.sleep(max(0.0, next_step - loop.time()))
            steps = 1
            # The loop came late: the steps it missed are delivered now, each its own deltas, as
            # the engine process's passes wait in its pipe and are all read at once.
            while loop.time() >= next_step + self.step_s:
                next_step += self.step_s
                steps += 1
            for _ in range(steps):
                self._step()

    def _step(self) -> None:
        for rid, (queue, request, done) in list(self.open.items()):
            i, n = done[0], request.sampling.max_tokens
            done[0] += 1
            last = done[0] >= n
            if last:
                del self.open[rid]
            self._stats.tokens_decoded += 1
            queue.put_nowait(
                TokenDelta(
                    rid,
                    [self.body[i % len(self.body)]],
                    finish_reason="length" if last else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                )
            )

    def stats(self) -> EngineStats:
        self._stats.running = len(self.open)
        return self._stats

    async def shutdown(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()


async def main(args) -> dict:
    engine = PacedEngine(args.step_ms / 1000)
    async with bench_engine.loopback_server(engine) as base_url:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "r.json"
            cmd = [sys.executable, "-m", "agent_server.cli", "bench", "serve", "--base-url", base_url]
            cmd += ["--max-concurrency", str(args.concurrency), "--num-prompts", str(args.requests)]
            cmd += ["--input-len", "64", "--output-len", str(args.output_len), "--ignore-eos", "--no-progress"]
            cmd += ["--warmup", "0", "--json", str(out), "--client-processes", str(args.client_processes)]
            start, cpu = time.perf_counter(), time.process_time()
            proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL)
            await proc.wait()
            summary = json.loads(out.read_text())
            wall = time.perf_counter() - start
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            summary["cpu_share"] = {  # of the run's wall time: 100% is one core kept busy
                "server": (time.process_time() - cpu) / wall,
                "client": (children.ru_utime + children.ru_stime) / wall,
            }
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--client-processes", type=int, default=1)
    args = ap.parse_args()
    s = bench_engine.run_serving_loop(main(args))
    offered = args.concurrency / (args.step_ms / 1000)
    itl = s["itl_ms"]
    errors = f" {s['errors']}" if s["errors"] else ""
    print(
        f"offered {offered:,.0f} tok/s; delivered {s['output_throughput']:,.0f} tok/s "
        f"({s['output_throughput'] / offered:.0%}); failed {s['failed']}{errors}; ITL {itl}; "
        f"CPU of the run's wall time: server {s['cpu_share']['server']:.0%}, client {s['cpu_share']['client']:.0%}; "
        f"server CPU a token {s['cpu_share']['server'] * 1e6 / s['output_throughput']:.0f} us"
    )
