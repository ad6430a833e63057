"""Tensor-parallel decode speed, where its time goes, and agreement: gpt-oss shapes, random weights.

Sections, in order (each prints as it finishes; `--budget` skips what would not fit):
  1. collectives: the all-reduce alone, N processes on N GPUs, for the messages a decode step
     sends (1 to 256 rows of 2880 float32 values): NCCL (float32, and bf16 as before), the
     peer-memory one-shot and two-shot kernels, each captured in a CUDA graph; their sums checked
     against NCCL's (`inference/distributed/peer_memory.py`).
  2. for each model and tensor-parallel size, one engine (`inference/engine/executor.py` spawns a
     process per extra GPU) on random weights of the real shapes, the same seed for every size,
     through the whole engine (scheduler, CUDA-graph decode, all-reduces, greedy sampling):
       * decode tok/s at each batch size (`--batches`), every sequence `--prompt` tokens in;
       * per-step breakdown: the same steps with the all-reduces left out (tp_all_reduce
         "none": wrong tokens, right timing) give compute; the difference is the collectives.
         And the kernels of a few steps on rank 0 by kind (torch.profiler);
       * the A/B: the same steps with every all-reduce through NCCL;
       * agreement with the first size: `--check` prompts decode `--check-tokens` greedy tokens,
         token for token; where a sequence parts from the first size's, that size's top-2
         margin there says whether it was a near tie (below `--near-tie`, bf16's resolution at
         these logits). Once with decisive routing (every token the same experts, so that a
         router near-tie flipped by rounding does not decide: the kernels are compared) and once
         with the random routers (how often such flips part the outputs);
  3. expert parallelism (`--ep`): at the largest size, the MoE split by whole experts, against
     tensor parallelism at `--ep-batches`.
Prints Markdown tables; `--json` writes everything (rewritten after each section).

    python benchmarks/bench_tensor_parallel.py --quick --model 120b --tp 1,2,4      # 4 GPUs
    python benchmarks/bench_tensor_parallel.py --quick --model 20b --tp 1,2         # 2 GPUs
    python benchmarks/bench_tensor_parallel.py --quick --model tiny --device cpu --tp 1,2 --prompt 16 \
        --batches 1,4 --ep-batches 4,8                                              # the script itself, on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.config import GPT_OSS_SHAPES, EngineConfig, ModelConfig  # noqa: E402
from inference.engine.core import LLMEngine  # noqa: E402
from inference.engine.executor import ModelSource, start_tensor_parallel  # noqa: E402
from inference.model.tiny_checkpoint import hf_config_dict  # noqa: E402
from inference.request import GenerationRequest, SamplingParams  # noqa: E402

HIDDEN = 2880
START = time.monotonic()
# A tiny model that splits 4 ways, for trying this script on CPU (`--model tiny --device cpu`).
SHAPES = {**GPT_OSS_SHAPES, "tiny": dict(num_key_value_heads=4, intermediate_size=128)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - START:.0f}s] {msg}", file=sys.stderr, flush=True)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200_000) for _ in range(length)] for _ in range(count)]


# ----------------------------------------------------------------------------- 1. the collective alone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_rank(rank: int, size: int, port: int, rows_list: list[int], calls: int, queue) -> None:
    try:
        result = _time_collectives(rank, size, port, rows_list, calls)
    except BaseException:
        result = {"error": traceback.format_exc()}
    if rank == 0 or "error" in result:
        queue.put(result)


def _time_collectives(rank: int, size: int, port: int, rows_list: list[int], calls: int) -> dict:
    """Per message size: µs per all-reduce for each implementation, replayed from a CUDA graph
    of `calls` of them back to back; and the peer-memory sums' largest difference from NCCL's."""
    import torch.distributed as dist

    from inference.distributed.peer_memory import PeerAllReduce, disable_multicast_environment

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    disable_multicast_environment()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size)
    try:
        dist.all_reduce(torch.zeros(1, device=device))
        peer, why = PeerAllReduce.create(dist.group.WORLD, device, max(rows_list) * HIDDEN * 4, list(range(size)))
        rows_out = {}
        for rows in rows_list:
            x = torch.randn(rows, HIDDEN, device=device, generator=torch.Generator(device).manual_seed(rank))
            want = x.clone()
            dist.all_reduce(want)
            row = {"bytes": x.numel() * 4}
            impls = {"nccl_f32": lambda: dist.all_reduce(x.clone()), "nccl_bf16": lambda: dist.all_reduce(x.bfloat16())}
            if peer is not None:
                row["max_rel_diff_vs_nccl"] = ((peer(x) - want).abs().max() / want.abs().max()).item()

                def forced(limit):
                    def run():
                        peer.one_shot_max_bytes = limit
                        return peer(x)

                    return run

                impls["one_shot"] = forced(1 << 40)
                impls["two_shot"] = forced(0)
            for name, fn in impls.items():
                row[name + "_us"] = _graph_us(fn, calls)
            if peer is not None:
                from inference.distributed.peer_memory import ONE_SHOT_MAX_BYTES

                peer.one_shot_max_bytes = ONE_SHOT_MAX_BYTES
            rows_out[rows] = row
        return {"size": size, "peer": why or "ok", "rows": rows_out}
    finally:
        dist.destroy_process_group()


def _graph_us(fn, calls: int, replays: int = 20) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / replays / calls
    del graph
    return round(us, 2)


def bench_collectives(size: int, rows_list: list[int], calls: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, size, port, rows_list, calls, queue)) for r in range(size)]
    for proc in procs:
        proc.start()
    try:
        result = queue.get(timeout=240)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return result


def print_collectives(result: dict) -> None:
    if "error" in result:
        print(f"\ncollectives: failed\n```\n{result['error']}\n```")
        return
    print(f"\nAll-reduce alone on {result['size']} GPUs, µs per call in a CUDA graph (peer memory: {result['peer']})\n")
    print("| rows | KB | NCCL f32 | NCCL bf16 | one-shot | two-shot | peer vs NCCL (max rel diff) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows, r in result["rows"].items():
        print(
            f"| {rows} | {r['bytes'] / 1024:.1f} | {r['nccl_f32_us']} | {r['nccl_bf16_us']} | "
            f"{r.get('one_shot_us', '-')} | {r.get('two_shot_us', '-')} | {r.get('max_rel_diff_vs_nccl', '-')} |"
        )


# ----------------------------------------------------------------------------- 2. the engine


def run_prefill(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    for i, p in enumerate(prompts(batch, prompt_len, seed=seed)):
        engine.add_request(
            GenerationRequest(f"b{batch}-{seed}-{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens))
        )
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_computed < seq.num_prompt_tokens for seq in scheduler.running):
        engine.step()


def abort_all(engine: LLMEngine) -> None:
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(seq.request_id)


def decode_speed(engine: LLMEngine, batch: int, args, seed: int = 0) -> dict:
    """Decode tok/s and ms a step with `batch` sequences running (all prefilled before the clock)."""
    run_prefill(engine, batch, args.prompt, args.warmup + args.steps + 4, seed)
    for _ in range(args.warmup):
        engine.step()
    sync()
    t0 = time.perf_counter()
    tokens = sum(len(d.token_ids) for _ in range(args.steps) for d in engine.step())
    elapsed = time.perf_counter() - t0
    abort_all(engine)
    return {"tok_s": round(tokens / elapsed, 1), "step_ms": round(elapsed / args.steps * 1e3, 3)}


KINDS = [  # kernel name patterns -> kind (first match)
    ("collective", ("nccl", "all_reduce", "allreduce", "one_shot", "two_shot", "allgather", "all_gather")),
    ("moe", ("moe", "gemv_gate", "gemv_down", "grouped", "router", "route_top", "align")),
    ("attention", ("attention", "attn", "rope", "prefill", "decode_kernel", "paged", "kv")),
    ("dense", ("linear", "gemm", "gemv", "sm90", "cutlass", "nvjet", "xmma", "cublas")),
    ("norm", ("rms", "norm")),
    ("sampling", ("argmax", "topk", "softmax", "sort")),
]


def kernel_breakdown(engine: LLMEngine, batch: int, args, steps: int = 6) -> dict:
    """Rank 0's kernels over `steps` decode steps at `batch`, µs a step by kind (torch.profiler:
    a collective's kernel time includes its wait for the other ranks)."""
    run_prefill(engine, batch, args.prompt, steps + 6, seed=7)
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    abort_all(engine)
    kinds: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        total = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if total <= 0:
            continue
        name = evt.key.lower()
        kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
        kinds[kind] += total / steps
    out = {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    out["kernels_total"] = round(sum(kinds.values()), 1)
    out["wall"] = round(wall / steps * 1e6, 1)
    return out


def greedy_outputs(engine: LLMEngine, prompt_list, max_tokens: int, logprobs: int | None):
    """Per prompt: (tokens, top-2 logprob margin at each step, or [] without logprobs)."""
    for i, p in enumerate(prompt_list):
        engine.add_request(
            GenerationRequest(f"check-{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs))
        )
    out = {i: ([], []) for i in range(len(prompt_list))}
    while engine.has_unfinished():
        for d in engine.step():
            tokens, margins = out[int(d.request_id.split("-")[1])]
            tokens.extend(d.token_ids)
            margins.extend(lp.top[0][1] - lp.top[1][1] for lp in d.logprobs or [])
    return [out[i] for i in range(len(prompt_list))]


def compare(reference, candidate, near_tie: float) -> dict:
    """Token-for-token agreement; each parting sequence's step and the reference's margin there."""
    equal, partings = 0, []
    for (ref_tokens, ref_margins), (tokens, _) in zip(reference, candidate):
        step = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
        if step is None:
            equal += 1
        else:
            partings.append({"step": step, "reference_margin": round(ref_margins[step], 4)})
    return {
        "sequences": len(reference),
        "equal": equal,
        "partings": partings,
        "all_partings_near_ties": all(p["reference_margin"] < near_tie for p in partings),
    }


def agreement(engine: LLMEngine, args, check_prompts, reference: dict | None, is_reference: bool) -> dict:
    """Greedy outputs with decisive and with random routing; against `reference` (the first
    size's, which wants logprobs for its margins: the others take the vocabulary-parallel argmax)."""
    found = {}
    for mode in ("decisive", "random"):
        engine.configure_tensor_parallel(decisive_routing=mode == "decisive")
        try:
            found[mode] = greedy_outputs(engine, check_prompts, args.check_tokens, 2 if is_reference else None)
        finally:
            engine.configure_tensor_parallel(decisive_routing=False)
    if reference is None:
        return {"outputs": found}
    return {"outputs": found, **{mode: compare(reference[mode], found[mode], args.near_tie) for mode in found}}


def build_engine(model: str, size: int, args, batches: list[int], moe_parallel: str = "tensor") -> LLMEngine:
    """The engine, its decode graphs captured up to the largest of `batches` (and the check's)."""
    config = ModelConfig.from_dict(hf_config_dict(SHAPES[model]))
    max_len = args.prompt + args.warmup + args.steps + args.check_tokens + 64
    seqs = max(*batches, args.check)
    pages = -(-max_len // 16) * seqs + 64
    engine_config = EngineConfig(
        tensor_parallel_size=size,
        num_pages=pages,
        max_model_len=max_len,
        max_num_seqs=seqs,
        enforce_eager=args.enforce_eager,
        tp_all_reduce=args.all_reduce,
        moe_parallel=moe_parallel,
    )
    return start_tensor_parallel(
        ModelSource(random_config=config, seed=0),
        engine_config,
        LLMEngine,
        device=args.device,
        model_name=f"gpt-oss-{model}-random",
    )


def close_engine(engine: LLMEngine | None) -> None:
    if engine is not None:
        engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_size(model: str, size: int, args, check_prompts, reference, results: list, budget) -> dict | None:
    row: dict = {"model": model, "tp": size, "moe_parallel": "tensor", "decode": {}, "breakdown": {}}
    results.append(row)
    progress(f"gpt-oss-{model} (random weights), tensor_parallel_size {size}: building")
    t0 = time.monotonic()
    engine = None
    # At the size expert parallelism is compared at, tensor parallelism runs its batches too.
    batches = list(args.batch_list) + (
        [b for b in args.ep_batch_list if b not in args.batch_list]
        if args.ep and size == max(args.tp_list) and size > 1
        else []
    )
    try:
        engine = build_engine(model, size, args, batches)
        row["build_s"] = round(time.monotonic() - t0, 1)
        tp = engine.model.tp
        row["all_reduce"] = (
            "none"
            if tp is None
            else ("peer memory + NCCL" if tp.mode == "peer" else f"NCCL ({tp.peer_unavailable or 'asked for'})")
        )
        progress(f"  ready in {row['build_s']} s; small all-reduces: {row['all_reduce']}")
        # An unmeasured round first: the first steps after a build compile and tune kernels on
        # the host (once measured: TP 1 batch 1 at 14 tok/s, its next round at ~700).
        for batch in batches:
            decode_speed(engine, batch, argparse.Namespace(**{**vars(args), "steps": 2}))
        for batch in batches:
            row["decode"][batch] = decode_speed(engine, batch, args)
            progress(f"  batch {batch}: {row['decode'][batch]}")
        if not args.no_profile and args.device == "cuda":
            for batch in args.profile_batch_list:
                try:
                    row["breakdown"][f"kernels_b{batch}"] = kernel_breakdown(engine, batch, args)
                    progress(f"  kernels a step, batch {batch} (µs): {row['breakdown'][f'kernels_b{batch}']}")
                except Exception as e:  # the profiler is a nicety
                    progress(f"  profiler failed: {e}")
        if budget("agreement"):
            found = agreement(engine, args, check_prompts, reference, reference is None)
            row["agreement"] = {k: v for k, v in found.items() if k != "outputs"}
            if reference is None:
                reference = found["outputs"]
                row["reference_outputs"] = True
            else:
                progress(f"  agreement with tp {args.tp_list[0]}: {row['agreement']}")
        if size > 1:
            # The A/B (all NCCL; --quick: at the largest size only), then compute alone (the
            # engine is closed after).
            modes = ("nccl", "none") if not args.quick or size == max(args.tp_list) else ("none",)
            for mode in modes:
                if not budget(f"tp_all_reduce={mode}"):
                    break
                engine.configure_tensor_parallel(all_reduce=mode)
                row["breakdown"][mode] = {b: decode_speed(engine, b, args) for b in args.batch_list}
                progress(f"  tp_all_reduce={mode}: {row['breakdown'][mode]}")
    except Exception:
        row["error"] = traceback.format_exc()
        progress(f"  failed:\n{row['error']}")
    finally:
        close_engine(engine)
    return reference


def bench_expert_parallel(model: str, size: int, args, check_prompts, reference, results: list) -> None:
    row: dict = {"model": model, "tp": size, "moe_parallel": "expert", "decode": {}}
    results.append(row)
    progress(f"gpt-oss-{model}, tensor_parallel_size {size}, moe_parallel expert: building")
    t0 = time.monotonic()
    engine = None
    try:
        engine = build_engine(model, size, args, args.ep_batch_list, moe_parallel="expert")
        row["build_s"] = round(time.monotonic() - t0, 1)
        for batch in args.ep_batch_list:
            row["decode"][batch] = decode_speed(engine, batch, args)
            progress(f"  batch {batch}: {row['decode'][batch]}")
        if reference is not None:
            found = agreement(engine, args, check_prompts, reference, False)
            row["agreement"] = {k: v for k, v in found.items() if k != "outputs"}
            progress(f"  agreement with tp {args.tp_list[0]}: {row['agreement']}")
    except Exception:
        row["error"] = traceback.format_exc()
        progress(f"  failed:\n{row['error']}")
    finally:
        close_engine(engine)


def print_tables(results: list, args) -> None:
    for model in args.model_list:
        rows = [r for r in results if r.get("model") == model]
        if not rows:
            continue
        batches = sorted({b for r in rows for b in r["decode"]})
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
        print(
            f"\ngpt-oss-{model} shapes, random weights, {device}, "
            f"{'eager' if args.enforce_eager or args.device != 'cuda' else 'CUDA graphs'}; decode tok/s (ms a step), context ~{args.prompt}\n"
        )
        print(
            "| TP | MoE | " + " | ".join(f"batch {b}" for b in batches) + f" | greedy = TP {args.tp_list[0]} "
            "(decisive routing) | (random routers) |"
        )
        print("|---|---|" + "---:|" * len(batches) + "---|---|")
        for r in rows:
            cells = [
                f"{r['decode'][b]['tok_s']:.0f} ({r['decode'][b]['step_ms']:.2f})" if b in r["decode"] else ""
                for b in batches
            ]
            agree = r.get("agreement", {})
            text = []
            for mode in ("decisive", "random"):
                a = agree.get(mode)
                if a is None:
                    text.append("(reference)" if r.get("reference_outputs") else "")
                else:
                    margins = ", ".join(f"{p['reference_margin']}@{p['step']}" for p in a["partings"])
                    text.append(
                        f"{a['equal']}/{a['sequences']} equal" + (f"; partings at margin {margins}" if margins else "")
                    )
            if "error" in r:
                text = ["failed: " + r["error"].strip().splitlines()[-1], ""]
            print(f"| {r['tp']} | {r['moe_parallel']} | " + " | ".join(cells) + f" | {text[0]} | {text[1]} |")
        split = [r for r in rows if r.get("breakdown", {}).get("none")]
        if split:
            print(
                "\nPer step (ms): with peer memory / all NCCL / no all-reduce at all (compute); collectives = first - last\n"
            )
            print("| TP | batch | peer memory + NCCL | NCCL only | compute | collectives |")
            print("|---|---:|---:|---:|---:|---:|")
            for r in split:
                for b in args.batch_list:
                    auto, nccl, none = (
                        r["decode"].get(b),
                        r["breakdown"].get("nccl", {}).get(b),
                        r["breakdown"]["none"].get(b),
                    )
                    if auto and none:
                        print(
                            f"| {r['tp']} | {b} | {auto['step_ms']:.3f} | {nccl['step_ms'] if nccl else '-'} | "
                            f"{none['step_ms']:.3f} | {auto['step_ms'] - none['step_ms']:.3f} |"
                        )
        kernel_rows = [(r, k, v) for r in rows for k, v in r.get("breakdown", {}).items() if k.startswith("kernels_")]
        if kernel_rows:
            print(
                "\nRank 0's kernels a step (µs, torch.profiler; a collective's time includes its wait for the others)\n"
            )
            for r, k, v in kernel_rows:
                print(
                    f"- TP {r['tp']}, batch {k.split('_b')[1]}: " + ", ".join(f"{name} {us}" for name, us in v.items())
                )


def environment() -> dict:
    count = torch.cuda.device_count()
    env = {
        "torch": torch.__version__,
        "gpus": count,
        "gpu": torch.cuda.get_device_name(0) if count else "none",
        "p2p": {
            f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(count) for j in range(count) if i != j
        },
    }
    try:
        env["topology"] = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20
        ).stdout
    except Exception as e:
        env["topology"] = f"nvidia-smi topo -m failed: {e}"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="20b", help="20b, 120b or both (comma-separated); tiny: to try it on CPU")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script (gloo, --model tiny)")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated (first: the reference)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt", type=int, default=128, help="tokens each sequence holds before decode")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--check", type=int, default=8, help="prompts for the greedy agreement check")
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument(
        "--near-tie",
        type=float,
        default=2**-5,
        help="a parting counts as a near tie below this top-2 logit margin (bf16's step at "
        "logits of 4-8, what random weights give)",
    )
    parser.add_argument("--all-reduce", default="auto", help="tp_all_reduce for the engines (auto, symm_mem, nccl)")
    parser.add_argument(
        "--ep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="expert parallelism at the largest size, against tensor parallelism",
    )
    parser.add_argument("--ep-batches", default="64,256")
    parser.add_argument("--profile-batches", default="1,64", help="batches whose kernels are profiled on rank 0")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-collectives", action="store_true", help="skip the all-reduce microbenchmark")
    parser.add_argument("--collective-rows", default="1,8,64,256")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer steps and prompts, the collectives and the NCCL A/B at the largest size only, "
        "and a time budget (--budget): 120b at TP 1/2/4 in ~8 min",
    )
    parser.add_argument("--budget", type=float, help="seconds; sections that start later are skipped (quick: 540)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.check, args.check_tokens = 4, 24, 4, 24
        args.budget = args.budget or 540
    args.model_list = args.model.split(",")
    args.tp_list = [int(x) for x in args.tp.split(",")]
    args.batch_list = [int(x) for x in args.batches.split(",")]
    args.ep_batch_list = [int(x) for x in args.ep_batches.split(",")]
    args.profile_batch_list = [int(x) for x in args.profile_batches.split(",")]
    if args.device == "cuda" and torch.cuda.device_count() < max(args.tp_list):
        sys.exit(f"--tp {max(args.tp_list)} needs {max(args.tp_list)} GPUs; {torch.cuda.device_count()} visible")

    def budget(what: str) -> bool:
        if args.budget is None or time.monotonic() - START < args.budget:
            return True
        progress(f"skipped {what}: past the {args.budget:.0f} s budget")
        return False

    report: dict = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "environment": environment()}
    progress(
        f"torch {report['environment']['torch']}, {report['environment']['gpus']} x "
        f"{report['environment']['gpu']}; P2P: {report['environment']['p2p']}"
    )
    print(report["environment"]["topology"])

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))

    report["collectives"] = []
    if not args.no_collectives and args.device == "cuda":
        sizes = sorted({s for s in args.tp_list if s > 1})
        for size in sizes[-1:] if args.quick else sizes:  # --quick: the largest only
            progress(f"collectives on {size} GPUs")
            try:
                result = bench_collectives(size, [int(x) for x in args.collective_rows.split(",")], 20)
            except Exception:
                result = {"size": size, "error": traceback.format_exc()}
            report["collectives"].append(result)
            print_collectives(result)
            save()
    report["engines"] = results = []
    check_prompts = prompts(args.check, args.prompt, seed=12345)
    for model in args.model_list:
        reference = None
        for size in args.tp_list:
            if not budget(f"gpt-oss-{model} at tensor_parallel_size {size}"):
                continue
            reference = bench_size(model, size, args, check_prompts, reference, results, budget)
            save()
        largest = max(args.tp_list)
        if args.ep and largest > 1 and budget(f"gpt-oss-{model} expert parallel"):
            bench_expert_parallel(model, largest, args, check_prompts, reference, results)
            save()
    print_tables(results, args)
    save()
    progress("done")


if __name__ == "__main__":
    main()
