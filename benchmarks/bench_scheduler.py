"""The engine's per-step host work that grows with the batch: scheduling a decode step of B
sequences and applying its tokens, on the CPU, with no model.

With async scheduling this work runs while the device computes the step before; it is hidden
as long as it takes less than that step (at 256 sequences the engine's whole host share is
about 7.7 ms against a 12 ms step of 20b on an H200, docs/benchmark-log.md), and it sets the pace
once the kernels are faster than it. The script drives the real `Scheduler`, `KVCacheManager`
and `StepOverlap` the way `LLMEngine` does: B sequences with `--prompt` tokens each, prefilled,
then decode steps that append one token a sequence and publish full pages for prefix sharing.
It prints µs a step for the synchronous scheduler (`schedule`) and for the step launched
ahead (`StepOverlap.next_batch`).

    python benchmarks/bench_scheduler.py --batches 64,256,512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.request import SamplingParams  # noqa: E402
from inference.scheduling.async_scheduling import StepOverlap  # noqa: E402
from inference.scheduling.kv_cache import KVCacheManager  # noqa: E402
from inference.scheduling.scheduler import ScheduledBatch, Scheduler, Sequence  # noqa: E402

PAGE_SIZE = 16
WINDOW = 128  # gpt-oss's sliding layers


def decoding_batch(batch: int, prompt: int, steps: int) -> tuple[Scheduler, KVCacheManager]:
    """A scheduler holding `batch` sequences that have prefilled `prompt` tokens each."""
    pages = 2 * batch * (-(-(prompt + steps + 64) // PAGE_SIZE))  # room to spare: no preemption
    cache = KVCacheManager(pages, pages, PAGE_SIZE, WINDOW)
    scheduler = Scheduler(
        cache, max_num_seqs=batch, max_num_batched_tokens=max(8192, batch), max_prefill_tokens_decoding=1024
    )
    for i in range(batch):
        tokens = [(i * 7919 + j) % 200_000 for j in range(prompt)]  # distinct prompts: no prefix hits
        scheduler.add(Sequence(str(i), tokens, prompt, SamplingParams(max_tokens=10**6)))
    while any(seq.num_computed < seq.num_prompt_tokens for seq in [*scheduler.running, *scheduler.waiting]):
        apply(cache, scheduler.schedule())
    return scheduler, cache


def apply(cache: KVCacheManager, batch: ScheduledBatch) -> None:
    """What `LLMEngine._apply` does to the host's state: the step's tokens computed, one sampled
    token appended where a sequence reached its end, full pages published."""
    for seq, n in zip(batch.seqs, batch.num_new):
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(seq.num_computed % 200_000)
        cache.register_computed(seq.pages, seq.token_ids, seq.num_computed)


def time_steps(batch: int, prompt: int, steps: int) -> dict[str, float]:
    """Median µs of `steps` steps each way (the median: other work on the machine shows up as
    outliers)."""
    scheduler, cache = decoding_batch(batch, prompt, 2 * steps)
    sync = []
    for _ in range(steps):
        t0 = time.perf_counter()
        apply(cache, scheduler.schedule())
        sync.append(time.perf_counter() - t0)
    overlap = StepOverlap(scheduler, max_model_len=10**6)
    launched = scheduler.schedule()
    ahead = []
    for _ in range(steps):
        t0 = time.perf_counter()
        following = overlap.next_batch(launched)
        assert following is not None, "the decode step could not be launched ahead"
        apply(cache, launched)
        ahead.append(time.perf_counter() - t0)
        launched = following
    return {"schedule_us": statistics.median(sync) * 1e6, "next_batch_us": statistics.median(ahead) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(
        f"host µs a decode step (scheduling and applying its tokens), {args.prompt}-token prompts, page size {PAGE_SIZE}, window {WINDOW}\n"
    )
    print("| sequences | synchronous (`schedule`) | launched ahead (`next_batch`) | µs a sequence |")
    print("| ---: | ---: | ---: | ---: |")
    for b in (int(x) for x in args.batches.split(",")):
        r = time_steps(b, args.prompt, args.steps)
        print(f"| {b} | {r['schedule_us']:,.0f} | {r['next_batch_us']:,.0f} | {r['schedule_us'] / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
