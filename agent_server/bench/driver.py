"""How a benchmark sends its requests: when each one starts, how many run at once, progress.

Arrivals: with `--request-rate R` the gaps between requests are drawn from a gamma
distribution of mean 1/R and shape `--burstiness` (1 is a Poisson process; below 1 burstier,
above 1 more regular); with no rate every request is sent at once. `--max-concurrency` caps
how many are in flight; a request waiting for a slot is not timed yet (its TTFT starts when
it is actually sent).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable

from tqdm import tqdm

from agent_server.bench.report import RequestResult
from agent_server.bench.workload import BenchRequest
from inference.gc_policy import settled_heap

SendRequest = Callable[[BenchRequest], Awaitable[RequestResult]]


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests per second (default: all at once)"
    )
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    group.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    group.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="requests sent one at a time before the measured run, not counted (default 1)",
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    group.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON here")


def check_load_arguments(args: argparse.Namespace) -> None:
    if not args.request_rate > 0:
        raise SystemExit("--request-rate must be > 0")
    if not args.burstiness > 0:
        raise SystemExit("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be >= 0")


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each of `n` requests (the first is sent at once)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


async def drive(
    requests: list[BenchRequest],
    send: SendRequest,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "requests",
) -> tuple[list[RequestResult], float, float]:
    """Send every request; returns (results in request order, start, duration in seconds)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=not progress, leave=False)

    async def one(request: BenchRequest) -> RequestResult:
        try:
            if slots is None:
                return await send(request)
            async with slots:
                return await send(request)
        except Exception as e:  # a client-side bug must not lose the other results
            return RequestResult(request.prompt_len, request.output_len, error=f"{type(e).__name__}: {e}")
        finally:
            bar.update(1)

    tasks = []
    # The client's own collector pauses (full collections of 130-210 ms at 256 streams) would
    # count as late tokens: out of the way while it measures (inference/gc_policy.py).
    with settled_heap():
        start = time.perf_counter()
        try:
            for request, gap in zip(requests, arrival_gaps(len(requests), request_rate, burstiness, seed)):
                if gap:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one(request)))
            results = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
        duration = time.perf_counter() - start
    return results, start, duration
