"""Attention kernel benchmark: paged sink attention (decode and prefill), the RoPE + KV write, and
the decode kernel with the step's RoPE + KV write folded in (`--only new-kv`).

gpt-oss shapes (64 query heads, 8 KV heads, head_dim 64, bf16 or fp8 cache, 16-token pages scattered
at random over the pool). Prints, beside each time, what fraction of the GPU's measured ceilings
it reaches: device-to-device copy bandwidth (bytes read + written) for decode, where the floor is
reading every K/V entry once, and a large bf16 matmul's rate for prefill (causal FLOPs counted
exactly: 4 * D per visible (query, key, head)).

Decode is timed as the engine runs it, inside a CUDA graph (one replay = many calls), rotating
over several block tables so small shapes do not just measure L2.

`--flashinfer fa2,fa3` times flashinfer's paged sink-attention kernels (`inference/ops/attention/flashinfer.py`)
on the same shapes beside the Triton ones: device time from graph replays of already planned
calls, plus flashinfer's per-step host planning (`plan us`), which the engine pays once per step
and attention kind, outside any graph. Usage:

    python3 benchmarks/bench_attention.py [--sweep] [--flashinfer fa2,fa3] [--only new-kv,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from copy_bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/, the script's folder)
from cuda_timing import time_events, time_graph, time_graph_calls  # noqa: E402

from inference.ops.attention import triton as at  # noqa: E402
from inference.ops.attention.reference import AttentionMetadata  # noqa: E402
from inference.ops.attention.rope_cache import rope_and_write_kv_triton  # noqa: E402

HQ, HKV, D, PAGE, WINDOW = 64, 8, 64, 16, 128
DEV = torch.device("cuda")
BYTES = 2  # bf16


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    return 2 * 8192**3 / time_events(lambda: a @ b, reps=10)


class KVPool:
    """One big K/V cache (bf16, or fp8 with `--kv-dtype fp8`); each `table` call scatters
    sequences over random pages."""

    def __init__(self, max_tokens: int, dtype: torch.dtype = torch.bfloat16):
        self.num_pages = max_tokens // PAGE
        shape = (self.num_pages, PAGE, HKV, D)
        self.k = torch.randn(shape, device=DEV, dtype=torch.bfloat16).to(dtype)
        self.v = torch.randn(shape, device=DEV, dtype=torch.bfloat16).to(dtype)

    def table(self, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
        pages = -(-context // PAGE)
        assert batch * pages <= self.num_pages
        perm = torch.randperm(self.num_pages, generator=gen)[: batch * pages]
        return perm.view(batch, pages).to(torch.int32).to(DEV)


def metadata(q_lens: list[int], context_lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    total = sum(q_lens)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    slots = torch.full((total,), -1, dtype=torch.long, device=DEV)
    return AttentionMetadata(
        cu_seqlens_q=cu,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEV),
        block_tables={"full": table, "sliding": table},
        slot_mapping={"full": slots, "sliding": slots},
        positions=torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, context_lens)]).to(DEV),
        max_q_len=max(q_lens),
        q_lens=q_lens,
        context_lens_list=context_lens,
    )


def bench_decode(pool: KVPool, batch: int, context: int, window, cfg: at.DecodeConfig, calls: int = 20) -> dict:
    """Seconds per decode attention call (one layer), measured over CUDA graph replays."""
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    keys = min(context, window) if window else context
    kv_bytes = batch * keys * HKV * D * pool.k.element_size() * 2
    rotations = max(1, min(8, math.ceil(400e6 / kv_bytes)))  # several tables: stay out of L2
    steps = []
    for _ in range(rotations):
        q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
        meta = metadata([1] * batch, [context] * batch, pool.table(batch, context, gen))
        steps.append((q, meta))
    sinks = torch.randn(HQ, device=DEV)

    def run(i):
        q, meta = steps[i % rotations]
        return at.paged_sink_attention(
            q, pool.k, pool.v, meta, meta.block_tables["full"], sinks, D**-0.5, window, decode_cfg=cfg
        )

    seconds = time_graph_calls(run, rotations, calls)
    q_out_bytes = 2 * batch * HQ * D * BYTES
    sms = at.multiprocessors(DEV)
    splits = at.decode_num_splits(batch, HKV, keys, sms, cfg)
    return dict(
        seconds=seconds,
        bytes=kv_bytes + q_out_bytes,
        splits=splits,
        block_n=at.decode_block_n(batch, HKV, splits, sms, cfg),
    )


def flashinfer_attention(kernel: str, workspace=None):
    from inference.ops.attention.flashinfer import FlashInferAttention

    return FlashInferAttention(DEV, kernel, workspace=workspace)


def bench_flashinfer_decode(
    pool: KVPool, batch: int, context: int, window, kernel: str, workspace, calls: int = 20
) -> dict:
    """Like `bench_decode`, through flashinfer: one planned instance per rotation, the runs replayed
    from a CUDA graph; `plan_seconds` is the host time of one step's plan."""
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    keys = min(context, window) if window else context
    kv_bytes = batch * keys * HKV * D * BYTES * 2
    rotations = max(1, min(8, math.ceil(400e6 / kv_bytes)))
    steps, plan_times = [], []
    sinks = torch.randn(HQ, device=DEV)
    for _ in range(rotations):
        q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
        meta = metadata([1] * batch, [context] * batch, pool.table(batch, context, gen))
        fi = flashinfer_attention(kernel, workspace)
        fi.attention(q, pool.k, pool.v, meta, meta.block_tables["full"], sinks, D**-0.5, window)  # compile, plan
        torch.cuda.synchronize()
        for _ in range(5):  # host cost of planning a step (a new step each time)
            meta_again = metadata([1] * batch, [context] * batch, meta.block_tables["full"])
            t0 = time.perf_counter()
            fi.plan(meta_again, meta.block_tables["full"], window, torch.bfloat16, HQ, HKV, D, PAGE)
            plan_times.append(time.perf_counter() - t0)
        fi.plan(meta, meta.block_tables["full"], window, torch.bfloat16, HQ, HKV, D, PAGE)
        steps.append((fi, q, meta))

    def run(i):
        fi, q, meta = steps[i % rotations]
        return fi.attention(q, pool.k, pool.v, meta, meta.block_tables["full"], sinks, D**-0.5, window)

    seconds = time_graph_calls(run, rotations, calls)
    torch.cuda.synchronize()
    return dict(
        seconds=seconds, plan_seconds=statistics.median(plan_times), bytes=kv_bytes + 2 * batch * HQ * D * BYTES
    )


def bench_flashinfer_prefill(pool: KVPool, tokens: int, window, kernel: str, workspace) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    meta = metadata([tokens], [tokens], pool.table(1, tokens, gen))
    q = torch.randn(tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
    sinks = torch.randn(HQ, device=DEV)
    fi = flashinfer_attention(kernel, workspace)

    def run():
        return fi.attention(q, pool.k, pool.v, meta, meta.block_tables["full"], sinks, D**-0.5, window)

    def plan_and_run():  # a new step: plan, then run (what the engine pays eagerly)
        fresh = metadata([tokens], [tokens], meta.block_tables["full"])
        return fi.attention(q, pool.k, pool.v, fresh, fresh.block_tables["full"], sinks, D**-0.5, window)

    run()
    w = window or tokens
    visible = sum(min(i + 1, w) for i in range(tokens))
    return dict(
        seconds=time_graph(run),
        eager_seconds=time_events(plan_and_run),
        host_seconds=host_seconds(plan_and_run),
        flops=4 * D * HQ * visible,
    )


def host_seconds(fn, calls: int = 50) -> float:
    """Host time to issue one fn() (Python + launch), GPU work left running."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host


def bench_prefill(pool: KVPool, tokens: int, window, cfg: at.PrefillConfig) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    meta = metadata([tokens], [tokens], pool.table(1, tokens, gen))
    q = torch.randn(tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
    sinks = torch.randn(HQ, device=DEV)

    def run():
        return at.paged_sink_attention(
            q, pool.k, pool.v, meta, meta.block_tables["full"], sinks, D**-0.5, window, prefill_cfg=cfg
        )

    w = window or tokens
    visible = sum(min(i + 1, w) for i in range(tokens))  # (query, key) pairs, per head
    return dict(
        seconds=time_graph(run),
        eager_seconds=time_events(run),
        host_seconds=host_seconds(run),
        flops=4 * D * HQ * visible,
    )


def bench_rope(tokens: int) -> dict:
    qkv = torch.randn(tokens, HQ + 2 * HKV, D, device=DEV, dtype=torch.bfloat16)
    q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
    positions = torch.randint(0, 4096, (tokens,), device=DEV)
    cos_sin = torch.randn(4096, D, device=DEV)
    pages = -(-tokens // PAGE) + 1
    k_cache = torch.empty(pages, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(pages * PAGE, device=DEV)[:tokens]

    def run():
        return rope_and_write_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)

    moved = tokens * (HQ + 2 * HKV) * D * BYTES * 2  # read q, k, v; write q, k, v
    return dict(seconds=time_graph(run), host_seconds=host_seconds(run), bytes=moved)


def bench_decode_new_kv(pool: KVPool, batch: int, context: int, window, calls: int = 20) -> dict:
    """A decode step's RoPE + K/V cache write + attention, one layer: the two launches
    (`rope_and_write_kv_triton`, then `paged_sink_attention`) against the decode kernel that
    folds the first in (`decode_attention_with_new_kv`), each timed from CUDA graph replays over
    rotating block tables. Also returns the relative difference of their outputs."""
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    rotations = 4
    steps = []
    for _ in range(rotations):
        table = pool.table(batch, context, gen)
        meta = metadata([1] * batch, [context] * batch, table)
        pos = context - 1
        slots = table[:, pos // PAGE].long() * PAGE + pos % PAGE
        meta.slot_mapping = {"full": slots, "sliding": slots}
        qkv = torch.randn(batch, HQ + 2 * HKV, D, device=DEV, dtype=torch.bfloat16)
        steps.append((qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :], meta))
    cos_sin = torch.randn(context, D, device=DEV)
    sinks = torch.randn(HQ, device=DEV)

    def separate(i):
        q, k, v, meta = steps[i % rotations]
        q = rope_and_write_kv_triton(q, k, v, meta.positions, cos_sin, pool.k, pool.v, meta.slot_mapping["full"])
        return at.paged_sink_attention(q, pool.k, pool.v, meta, meta.block_tables["full"], sinks, D**-0.5, window)

    def folded(i):
        q, k, v, meta = steps[i % rotations]
        return at.decode_attention_with_new_kv(
            q,
            k,
            v,
            cos_sin,
            pool.k,
            pool.v,
            meta,
            meta.block_tables["full"],
            meta.slot_mapping["full"],
            sinks,
            D**-0.5,
            window,
        )

    a, b = separate(0).float(), folded(0).float()
    times = [time_graph_calls(f, rotations, calls) for f in (separate, folded, separate, folded)]
    return dict(
        separate_seconds=min(times[0], times[2]),
        folded_seconds=min(times[1], times[3]),
        rel_diff=float((a - b).norm() / a.norm()),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also try other launch configurations")
    ap.add_argument("--json", type=Path, help="write all results here")
    ap.add_argument("--flashinfer", default="", help="comma-separated flashinfer kernels to time too (fa2,fa3)")
    ap.add_argument(
        "--only", default="", help="comma-separated sections to run (decode, prefill, rope, new-kv); default: all"
    )
    ap.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="the cache's dtype (fp8: float8 e4m3, `EngineConfig.kv_cache_dtype`)",
    )
    args = ap.parse_args()
    if args.kv_dtype == "fp8" and args.flashinfer:
        ap.error("--flashinfer times bf16 caches only")
    sections = set(filter(None, args.only.split(","))) or {"decode", "prefill", "rope", "new-kv"}
    fi_kernels = [k for k in args.flashinfer.split(",") if k]
    workspace = None
    if fi_kernels:
        from inference.ops.attention.flashinfer import WORKSPACE_BYTES

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)

    props = torch.cuda.get_device_properties(DEV)
    bw, flops = copy_bandwidth(), matmul_flops()
    header = (
        f"{datetime.date.today()}  {props.name}  SMs={props.multi_processor_count}  torch {torch.__version__}"
        f"  triton {at.triton.__version__}\ncopy bandwidth {bw / 1e12:.2f} TB/s (read+write), "
        f"bf16 matmul {flops / 1e12:.0f} TFLOP/s"
    )
    print(header, flush=True)
    results: dict = {"header": header, "copy_bw": bw, "matmul_flops": flops, "decode": [], "prefill": [], "sweep": []}
    pool = KVPool(128 * 32768 + 8 * 1024, torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16)
    print(f"K/V cache: {pool.k.dtype}")

    print("\ndecode attention, one layer (split-K, CUDA graph replay)")
    print(f"{'layer':>8} {'batch':>5} {'context':>7} {'splits':>6} {'block_n':>7} {'us':>9} {'TB/s':>6} {'of copy':>7}")
    for window in (None, WINDOW) if "decode" in sections else ():
        for batch in (1, 32, 64, 128, 256, 512):
            # serving batches (256, 512) at a serving run's contexts; the pool holds 4.2M keys
            for context in (1024, 8192, 32768) if batch <= 128 else (1024, 2048):
                if window and context not in (8192, 2048):
                    continue
                r = bench_decode(pool, batch, context, window, at.DECODE)
                tbs = r["bytes"] / r["seconds"]
                r.update(window=window, batch=batch, context=context, tb_s=tbs / 1e12, of_copy=tbs / bw)
                results["decode"].append(r)
                print(
                    f"{'sliding' if window else 'full':>8} {batch:>5} {context:>7} {r['splits']:>6} {r['block_n']:>7} "
                    f"{r['seconds'] * 1e6:>9.1f} {tbs / 1e12:>6.2f} {tbs / bw:>7.0%}",
                    flush=True,
                )
                for kernel in fi_kernels:
                    f = bench_flashinfer_decode(pool, batch, context, window, kernel, workspace)
                    ftbs = f["bytes"] / f["seconds"]
                    f.update(
                        kernel=kernel,
                        window=window,
                        batch=batch,
                        context=context,
                        of_copy=ftbs / bw,
                        vs_triton=r["seconds"] / f["seconds"],
                    )
                    results.setdefault("flashinfer_decode", []).append(f)
                    print(
                        f"{'':>8} {'':>5} {'':>7} {'fi-' + kernel:>14} {f['seconds'] * 1e6:>9.1f} {ftbs / 1e12:>6.2f} "
                        f"{ftbs / bw:>7.0%}  plan {f['plan_seconds'] * 1e6:.0f} us  triton/fi {f['vs_triton']:.2f}",
                        flush=True,
                    )

    print("\nprefill attention, one sequence, one layer (device time from graph replay; eager call; host issue time)")
    print(f"{'layer':>8} {'tokens':>7} {'us':>9} {'TFLOP/s':>8} {'of matmul':>9} {'eager us':>9} {'host us':>8}")
    for window in (None, WINDOW) if "prefill" in sections else ():
        for tokens in (2048, 8192):
            r = bench_prefill(pool, tokens, window, at.PREFILL)
            rate = r["flops"] / r["seconds"]
            r.update(window=window, tokens=tokens, tflops=rate / 1e12, of_matmul=rate / flops)
            results["prefill"].append(r)
            print(
                f"{'sliding' if window else 'full':>8} {tokens:>7} {r['seconds'] * 1e6:>9.1f} "
                f"{rate / 1e12:>8.1f} {rate / flops:>9.0%} {r['eager_seconds'] * 1e6:>9.1f} "
                f"{r['host_seconds'] * 1e6:>8.1f}",
                flush=True,
            )
            for kernel in fi_kernels:
                f = bench_flashinfer_prefill(pool, tokens, window, kernel, workspace)
                frate = f["flops"] / f["seconds"]
                f.update(
                    kernel=kernel,
                    window=window,
                    tokens=tokens,
                    tflops=frate / 1e12,
                    of_matmul=frate / flops,
                    vs_triton=r["seconds"] / f["seconds"],
                )
                results.setdefault("flashinfer_prefill", []).append(f)
                print(
                    f"{'fi-' + kernel:>8} {tokens:>7} {f['seconds'] * 1e6:>9.1f} {frate / 1e12:>8.1f} "
                    f"{frate / flops:>9.0%} {f['eager_seconds'] * 1e6:>9.1f} {f['host_seconds'] * 1e6:>8.1f}"
                    f"  (eager/host include the plan)  triton/fi {f['vs_triton']:.2f}",
                    flush=True,
                )

    print("\nrope + KV write (device time from graph replay; host issue time)")
    for tokens in (64, 2048, 8192) if "rope" in sections else ():
        r = bench_rope(tokens)
        results.setdefault("rope", []).append(dict(r, tokens=tokens))
        print(
            f"{tokens:>7} tokens {r['seconds'] * 1e6:>8.1f} us  {r['bytes'] / r['seconds'] / bw:>5.0%} of copy  "
            f"host {r['host_seconds'] * 1e6:.1f} us",
            flush=True,
        )

    print("\ndecode with the step's RoPE + KV write, one layer, 1k context: two launches vs folded into attention")
    for batch in (1, 8, 32, 64, 128) if "new-kv" in sections else ():
        for window in (None, WINDOW):
            r = bench_decode_new_kv(pool, batch, 1024, window)
            results.setdefault("decode_new_kv", []).append(dict(r, batch=batch, window=window))
            print(
                f"{'sliding' if window else 'full':>8} {batch:>5}  separate {r['separate_seconds'] * 1e6:7.1f} us  "
                f"folded {r['folded_seconds'] * 1e6:7.1f} us  (x{r['separate_seconds'] / r['folded_seconds']:.2f}, "
                f"outputs differ by {r['rel_diff']:.1e})",
                flush=True,
            )

    if args.sweep and "decode" in sections:
        print("\nsweep: decode, full layer")
        default = at.DECODE
        grid = [(64, 8192, n, w, st, None) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
        grid += [(64, 8192, 32, default.num_warps, default.num_stages, sp) for sp in (1, 2, 4, 8)]
        grid += [(b, c, n, w, 3, None) for b, c in ((1, 32768), (128, 1024)) for n in (32, 64, 128) for w in (4, 8)]
        # serving batches: 2,048 or 4,096 (sequence, KV head) programs, no splits
        grid += [(b, 2048, n, w, st, None) for b in (256, 512) for n in (32, 64) for w in (2, 4, 8) for st in (2, 3, 4)]
        for batch, context, block_n, warps, stages, splits in grid:
            cfg = at.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
            try:
                r = bench_decode(pool, batch, context, None, cfg)
            except Exception as e:  # a configuration the compiler rejects
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            frac = r["bytes"] / r["seconds"] / bw
            results["sweep"].append(
                dict(
                    kind="decode",
                    batch=batch,
                    context=context,
                    cfg=repr(cfg),
                    seconds=r["seconds"],
                    of_copy=frac,
                    splits=r["splits"],
                )
            )
            print(
                f"  b{batch} ctx{context} n{block_n} w{warps} s{stages} splits={r['splits']}: "
                f"{r['seconds'] * 1e6:.1f} us {frac:.0%}",
                flush=True,
            )
    if args.sweep and "prefill" in sections:
        print("\nsweep: prefill 8k")
        grid = [(None, rows, n, w, 3) for rows in (64, 128) for n in (64, 128) for w in (4, 8)]
        grid += [(WINDOW, rows, 64, w, st) for rows in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        for window, rows, block_n, warps, stages in grid:
            cfg = at.PrefillConfig(
                rows=rows, block_n=block_n, num_warps=warps, num_stages=stages, sliding_num_stages=stages
            )
            try:
                r = bench_prefill(pool, 8192, window, cfg)
            except Exception as e:
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            rate = r["flops"] / r["seconds"]
            results["sweep"].append(
                dict(kind="prefill", window=window, cfg=repr(cfg), seconds=r["seconds"], of_matmul=rate / flops)
            )
            print(
                f"  {'sliding' if window else 'full'} rows{rows} n{block_n} w{warps} s{stages}: {r['seconds'] * 1e6:.1f} us "
                f"{rate / 1e12:.1f} TFLOP/s",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
