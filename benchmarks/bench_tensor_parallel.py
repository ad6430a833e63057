"""Tensor-parallel decode speed and agreement: gpt-oss shapes, random weights, 1 vs N GPUs.

For each tensor-parallel size the engine is built on random weights of the real shapes (the
same seed, so every size runs the same model; `inference/engine/executor.py` spawns one process
per extra GPU), then, through the whole engine (scheduler, CUDA-graph decode, all-reduces,
logits all-gather, greedy sampling on rank 0):
  * decode tok/s at each batch size, every sequence `--prompt` tokens in, timed over `--steps`
    steps after `--warmup`;
  * greedy agreement with the first size given: `--check` prompts generate `--check-tokens`
    tokens each, compared token for token; where they part, the first size's top-2 logprob
    margin there says whether it was a near tie (bf16 sums in another order pick either side
    of a near tie).
Prints a Markdown table for BENCHMARKS.md and, with --json, writes the numbers.

    python benchmarks/bench_tensor_parallel.py --model 20b --tp 1,2 --batches 1,64
    python benchmarks/bench_tensor_parallel.py --model 120b --tp 2,4,8 --batches 1,64
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.config import GPT_OSS_SHAPES, ModelConfig  # noqa: E402
from inference.config import EngineConfig
from inference.engine.core import LLMEngine  # noqa: E402
from inference.request import GenerationRequest, SamplingParams  # noqa: E402
from inference.engine.executor import ModelSource, start_tensor_parallel  # noqa: E402
from inference.model.tiny_checkpoint import hf_config_dict  # noqa: E402



def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200_000) for _ in range(length)] for _ in range(count)]


def decode_speed(engine: LLMEngine, batch: int, prompt_len: int, warmup: int, steps: int) -> float:
    """Decode tok/s with `batch` sequences running (all prefilled before the clock starts)."""
    for i, p in enumerate(prompts(batch, prompt_len, seed=batch)):
        engine.add_request(GenerationRequest(f"b{batch}-{i}", p,
                                             SamplingParams(temperature=0, max_tokens=warmup + steps + 2)))
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_computed < seq.num_prompt_tokens for seq in scheduler.running):
        engine.step()
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = sum(len(d.token_ids) for _ in range(steps) for d in engine.step())
    elapsed = time.perf_counter() - t0
    for seq in list(engine.scheduler.running):
        engine.abort(seq.request_id)
    return tokens / elapsed


def greedy_outputs(engine: LLMEngine, prompt_list: list[list[int]], max_tokens: int):
    """Per prompt: (tokens, top-2 logprob margin at each step)."""
    for i, p in enumerate(prompt_list):
        engine.add_request(GenerationRequest(f"check-{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                               logprobs=2)))
    out = {i: ([], []) for i in range(len(prompt_list))}
    while engine.has_unfinished():
        for d in engine.step():
            tokens, margins = out[int(d.request_id.split("-")[1])]
            tokens.extend(d.token_ids)
            margins.extend(lp.top[0][1] - lp.top[1][1] for lp in d.logprobs or [])
    return [out[i] for i in range(len(prompt_list))]


def compare(reference, candidate) -> dict:
    """Token-for-token agreement; for each sequence that parts, where and the reference's margin there."""
    equal, partings = 0, []
    for (ref_tokens, ref_margins), (tokens, _) in zip(reference, candidate):
        step = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
        if step is None:
            equal += 1
        else:
            partings.append({"step": step, "reference_margin": round(ref_margins[step], 4)})
    return {"sequences": len(reference), "equal": equal, "partings": partings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(GPT_OSS_SHAPES), default="20b")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated (first: the reference)")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt", type=int, default=128, help="tokens each sequence holds before decode")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--check", type=int, default=8, help="prompts for the greedy agreement check")
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(x) for x in args.tp.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if torch.cuda.device_count() < max(sizes):
        sys.exit(f"--tp {max(sizes)} needs {max(sizes)} GPUs; {torch.cuda.device_count()} visible")
    config = ModelConfig.from_dict(hf_config_dict(GPT_OSS_SHAPES[args.model]))
    max_len = args.prompt + args.warmup + args.steps + args.check_tokens + 64
    pages = -(-max_len // 16) * max(max(batches), args.check) + 64
    check_prompts = prompts(args.check, args.prompt, seed=12345)
    results, reference = [], None
    for size in sizes:
        progress(f"building gpt-oss-{args.model} (random weights) at tensor_parallel_size {size}")
        t0 = time.perf_counter()
        engine = start_tensor_parallel(
            ModelSource(random_config=config, seed=0), EngineConfig(tensor_parallel_size=size, num_pages=pages, max_model_len=max_len,
                         max_num_seqs=max(max(batches), args.check), enforce_eager=args.enforce_eager), LLMEngine,
            device="cuda", model_name=f"gpt-oss-{args.model}-random",
        )
        progress(f"  ready in {time.perf_counter() - t0:.0f} s")
        try:
            row = {"tp": size, "decode_tok_s": {}}
            for batch in batches:
                row["decode_tok_s"][batch] = decode_speed(engine, batch, args.prompt, args.warmup, args.steps)
                progress(f"  batch {batch}: {row['decode_tok_s'][batch]:.1f} tok/s")
            outputs = greedy_outputs(engine, check_prompts, args.check_tokens)
            if reference is None:
                reference = outputs
            else:
                row["greedy_vs_first"] = compare(reference, outputs)
                progress(f"  greedy vs tp {sizes[0]}: {row['greedy_vs_first']}")
            results.append(row)
        finally:
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()

    print(f"\ngpt-oss-{args.model} shapes, random weights, {torch.cuda.get_device_name(0)}, "
          f"{'eager' if args.enforce_eager else 'CUDA graphs'}; decode tok/s, context ~{args.prompt} tokens\n")
    print("| TP | " + " | ".join(f"batch {b}" for b in batches) + " | greedy = TP " + str(sizes[0]) + " |")
    print("|---|" + "---|" * len(batches) + "---|")
    for row in results:
        check = row.get("greedy_vs_first")
        agree = "(reference)" if check is None else f"{check['equal']}/{check['sequences']} sequences"
        print(f"| {row['tp']} | " + " | ".join(f"{row['decode_tok_s'][b]:.1f}" for b in batches) + f" | {agree} |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
