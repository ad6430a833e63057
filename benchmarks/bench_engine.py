"""End-to-end model speed on one GPU: decode tok/s by batch, prefill tok/s, batch-1 roofline.

Builds gpt-oss-20b or -120b with random weights of the real shapes directly on the GPU (MXFP4
experts), measures the device-to-device copy bandwidth in the same process, then times:
  * decode steps at each batch size with CUDA graphs (model + lm_head + greedy pick + reading the
    ids back to the host, as the engine does each step), every sequence at `--context` tokens;
  * prefill of one `--prefill`-token prompt.
Batch-1 tok/s is compared with the bandwidth roofline: bytes a token must read (docs/design.md §2) divided
by the measured copy bandwidth.

    python benchmarks/bench_engine.py --model 20b
    python benchmarks/bench_engine.py --model 120b --batches 1,64
    python benchmarks/bench_engine.py --model 20b --profile 1,64   # per-kernel breakdown of a step
    python benchmarks/bench_engine.py --model 20b --profile 256 --mixed-prompt 1024   # ... with a prompt joining
    python benchmarks/bench_engine.py --model 20b --hf             # also transformers, same shapes
    python benchmarks/bench_engine.py --model 20b --speculative ngram   # batch-1 decode with / without drafts
    python benchmarks/bench_engine.py --model 20b --async-scheduling --batches 1,8,64   # engine decode, overlap off / on
    python benchmarks/bench_engine.py --model 20b --timeline 1   # kernel timeline of engine steps (gaps)
    python benchmarks/bench_engine.py --model 20b --constrained --batches 1,64   # a JSON-schema request in the batch
    python benchmarks/bench_engine.py --model tiny --device cpu --constrained --batches 1,4 --context 64 --steps 20

With --speculative the script instead times batch-1 decode through the engine (scheduler, CUDA
graphs for decode and verification steps, sampler) on a repetitive prompt, with and without the
drafter, and prints tok/s and the mean acceptance length (tokens per verification step). Random
weights do not copy their prompt, so a logit bias confines the output to the prompt's words
(--spec-words, 0 to turn it off), graded (20, 18, 16, ...) so that the output mostly repeats the
favoured words and greedy choices are not near ties; that gives the n-gram drafter repetition to
find. A third row replays the plain run's own output as drafts: what a perfect drafter gets.

With --async-scheduling the script instead times decode through the whole engine at each batch
size (every sequence at `--context` tokens, greedy), with async scheduling off and on
(`inference/scheduling/async_scheduling.py`), beside the CUDA-graph replay alone. Host µs per step is the
engine thread's time per step outside waiting for sampled ids (the device's share): with the
overlap on, it is hidden as long as it stays below the graph's own step time.

With --constrained the script instead times decode through the engine at each batch size (async
scheduling on CUDA, greedy), once with every request free and once with one of them held to a
JSON schema (`inference/grammar.py`): tok/s of the whole batch and of its free rows, and the free
rows' slowdown. The constrained row's mask is computed on the host and applied on the device each
step; its step launched ahead samples once the previous token has advanced its grammar.
`--model tiny --device cpu` runs the same on the tiny random shapes, as a check of the script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from copy_bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/, the script's folder)
from matmul_rate import matmul_rate  # noqa: E402

from inference.config import GPT_OSS_SHAPES, ModelConfig  # noqa: E402
from inference.model.gpt_oss import GptOssModel  # noqa: E402
from inference.model.tiny_checkpoint import hf_config_dict  # noqa: E402
from inference.ops.attention.reference import FP8_KV_DTYPE, AttentionMetadata  # noqa: E402
from inference.runner.cuda_graphs import DecodeGraphRunner  # noqa: E402
from inference.spec_decode.drafter import DraftContext  # noqa: E402


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def expert_and_router_bytes(c: ModelConfig) -> tuple[float, float]:
    """(bytes of one expert: MXFP4 blocks + scales + f32 biases, bytes of one layer's router)."""
    h, i = c.hidden_size, c.intermediate_size
    expert = (2 * i * h + h * i) * (0.5 + 1 / 32) + (2 * i + h) * 4
    return expert, (c.num_local_experts * h + c.num_local_experts) * 2


def bytes_per_token(c: ModelConfig, context: int, kv_element: int = 2) -> dict[str, float]:
    """Bytes one batch-1 decode step must read (weights + KV at kv_element bytes a value), by part."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = (h * (q + 2 * kv) + q * h + (q + 2 * kv + h)) * 2 + c.num_attention_heads * 4 + 2 * h * 2
    expert_weights, router = expert_and_router_bytes(c)
    kv_bytes = 0.0
    for layer in range(c.num_hidden_layers):
        seen = min(context, c.sliding_window) if c.is_sliding(layer) else context
        kv_bytes += seen * 2 * kv * kv_element
    return {
        "attention": c.num_hidden_layers * attn,
        "experts": c.num_hidden_layers * (c.num_experts_per_tok * expert_weights + router),
        "lm_head": c.vocab_size * h * 2 + h * 2,
        "kv": kv_bytes,
    }


def step_roofline(c: ModelConfig, batch: int, context: int, kv_element: int = 2) -> dict[str, float]:
    """What one decode step of `batch` sequences at `context` tokens each must move and compute.
    bytes: the dense weights and the lm_head once, the experts the batch touches (E(1 - (1 - k/E)^B)
    a layer on average under uniform routing, which random weights approximate), and every
    sequence's KV. flops: 2 per weight a token uses, plus attention's 4 per key and query dim."""
    parts = bytes_per_token(c, context, kv_element)
    e, k = c.num_local_experts, c.num_experts_per_tok
    expert_bytes, router = expert_and_router_bytes(c)
    touched = e * (1 - (1 - k / e) ** batch)
    h, q, kv, i = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    )
    weights_a_token = c.num_hidden_layers * (h * (q + 2 * kv) + q * h + e * h + k * 3 * i * h) + c.vocab_size * h
    keys = sum(min(context, c.sliding_window) if c.is_sliding(n) else context for n in range(c.num_hidden_layers))
    return {
        "bytes": parts["attention"]
        + parts["lm_head"]
        + c.num_hidden_layers * router
        + c.num_hidden_layers * touched * expert_bytes
        + batch * parts["kv"],
        "flops": batch * (2 * weights_a_token + 4 * keys * q),
    }


def roofline_tok_s(
    c: ModelConfig, batch: int, context: int, bandwidth: float, flop_rate: float, kv_element: int = 2
) -> tuple[float, str]:
    """(tok/s if a step took max(bytes / bandwidth, flops / flop_rate), which of the two binds)."""
    r = step_roofline(c, batch, context, kv_element)
    memory, compute = r["bytes"] / bandwidth, r["flops"] / flop_rate
    return batch / max(memory, compute), ("memory" if memory >= compute else "compute")


ACTIVATION_RESERVE = 4e9  # bytes held back for a prefill step's activations and CUDA graphs


def kv_capacity(c: ModelConfig, weights_bytes: int, kv_element: int = 2) -> dict[str, int]:
    """KV bytes per cached token (full-attention layers; sliding layers hold at most a window per
    sequence) and the tokens that fit in an 80 GB H100 at 0.9 utilisation beside the weights."""
    full_layers = sum(not c.is_sliding(i) for i in range(c.num_hidden_layers))
    per_token = full_layers * 2 * c.num_key_value_heads * c.head_dim * kv_element  # K and V
    free = 80e9 * 0.9 - weights_bytes - ACTIVATION_RESERVE
    return {
        "weights_GB": round(weights_bytes / 1e9, 2),
        "kv_bytes_per_token": per_token,
        "kv_tokens_h100_80gb": int(free // per_token),
    }


class StaticBatch:
    """B sequences with `context` tokens each already in the cache, pages laid out contiguously."""

    def __init__(self, model: GptOssModel, kv_caches, batch: int, context: int, pages_per_seq: int, page_size: int):
        dev = model.device
        self.batch, self.page_size, self.context = batch, page_size, context
        self.lengths = torch.full((batch,), context, dtype=torch.int32, device=dev)
        table = torch.arange(batch * pages_per_seq, dtype=torch.int32, device=dev).view(batch, pages_per_seq)
        self.table = table
        self.ids = torch.randint(0, model.config.vocab_size, (batch,), device=dev)

    def metadata(self) -> AttentionMetadata:
        pos = self.lengths.long()
        page = self.table.gather(1, (pos // self.page_size).view(-1, 1)).view(-1).long()
        slots = page * self.page_size + pos % self.page_size
        self.lengths += 1
        self.context += 1
        return AttentionMetadata(
            cu_seqlens_q=torch.arange(self.batch + 1, dtype=torch.int32, device=pos.device),
            context_lens=self.lengths.clone(),
            block_tables={"full": self.table, "sliding": self.table},
            slot_mapping={"full": slots, "sliding": slots},
            positions=pos,
            max_q_len=1,
            q_lens=[1] * self.batch,
            context_lens_list=[self.context] * self.batch,
        )


def bench_decode(model, kv_caches, runner, batch, context, steps, pages_per_seq, page_size) -> float:
    seqs = StaticBatch(model, kv_caches, batch, context, pages_per_seq, page_size)
    ids = seqs.ids
    for _ in range(3):  # warm-up
        ids = runner.run(ids, seqs.metadata())[0].argmax(-1)
        ids.tolist()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = runner.run(ids, seqs.metadata())[0].argmax(-1)
        ids.tolist()  # the engine reads the sampled ids every step
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def bench_prefill(model, kv_caches, tokens: int, page_size: int, repeats: int = 5) -> float:
    """Prompt tokens/s of one `tokens`-token prefill step (a new step's metadata each time, as the
    engine builds it, so per-step planning of any attention backend is counted)."""
    dev = model.device
    table = torch.arange(-(-tokens // page_size), dtype=torch.int32, device=dev)[None]
    pos = torch.arange(tokens, device=dev)

    def step_metadata() -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
            block_tables={"full": table, "sliding": table},
            slot_mapping={"full": pos, "sliding": pos},
            positions=pos,
            max_q_len=tokens,
            q_lens=[tokens],
            context_lens_list=[tokens],
        )

    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=dev)
    for _ in range(2):
        model.compute_logits(model(ids, step_metadata(), kv_caches)[-1:])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        model.compute_logits(model(ids, step_metadata(), kv_caches)[-1:]).argmax(-1).tolist()
    torch.cuda.synchronize()
    return tokens * repeats / (time.perf_counter() - t0)


def mixed_step(seqs: StaticBatch, prompt: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """(input ids, metadata) of a step where one `prompt`-token request joins `seqs`'s decode
    rows, as the scheduler builds it: the decode rows first, then the prompt, on the pages after
    the batch's. Each call advances the decode rows by one token and re-prefills the prompt."""
    decode = seqs.metadata()
    dev, b, page = seqs.ids.device, seqs.batch, seqs.page_size
    first_page = seqs.table.shape[0] * seqs.table.shape[1]
    prompt_table = torch.zeros(1, seqs.table.shape[1], dtype=torch.int32, device=dev)
    pages = -(-prompt // page)
    prompt_table[0, :pages] = torch.arange(first_page, first_page + pages, dtype=torch.int32, device=dev)
    table = torch.cat([seqs.table, prompt_table])
    pos = torch.arange(prompt, device=dev)
    slots = torch.cat([decode.slot_mapping["full"], first_page * page + pos])
    ids = torch.cat([seqs.ids, torch.randint(0, 1000, (prompt,), device=dev)])
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([*range(b + 1), b + prompt], dtype=torch.int32, device=dev),
        context_lens=torch.cat([decode.context_lens, torch.tensor([prompt], dtype=torch.int32, device=dev)]),
        block_tables={"full": table, "sliding": table},
        slot_mapping={"full": slots, "sliding": slots},
        positions=torch.cat([decode.positions, pos]),
        max_q_len=prompt,
        q_lens=[1] * b + [prompt],
        context_lens_list=decode.context_lens_list + [prompt],
    )
    return ids, meta


def profile_step(model, kv_caches, batch, context, pages_per_seq, page_size, prompt: int = 0) -> str:
    """Per-kernel GPU time of one eager decode step of `batch` sequences (with `prompt`: beside
    a joining `prompt`-token request), top entries; with `prompt`, also the kernel time of the
    decode rows alone, the prompt alone and the two in one step. (Kernel time, not the eager
    step's wall time, which the host's launches can set.)"""
    from torch.profiler import ProfilerActivity, profile

    seqs = StaticBatch(model, kv_caches, batch, context, pages_per_seq, page_size)

    def step(ids, meta):
        # Logits of the rows the engine samples: each sequence's last (every decode row).
        hidden = model(ids, meta, kv_caches)
        return model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])

    def profiled(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn().argmax(-1).tolist()
            torch.cuda.synchronize()
        return prof.key_averages()

    def decode_rows():
        return step(seqs.ids, seqs.metadata())

    events = profiled((lambda: step(*mixed_step(seqs, prompt))) if prompt else decode_rows)
    table = events.table(sort_by="cuda_time_total", row_limit=15)
    if not prompt:
        return table
    alone = StaticBatch(model, kv_caches, 0, 0, pages_per_seq, page_size)
    alone.table = seqs.table  # the prompt on the same pages as in the mixed step

    def kernel_ms(averages) -> float:
        return sum(e.self_device_time_total for e in averages) / 1e3

    times = {
        "decode rows alone": kernel_ms(profiled(decode_rows)),
        f"{prompt}-token prompt alone": kernel_ms(profiled(lambda: step(*mixed_step(alone, prompt)))),
        "both in one step": kernel_ms(events),
    }
    lines = "\n".join(f"| {k} | {v:.2f} |" for k, v in times.items())
    return f"{table}\n| kernel time of one eager step | ms |\n| --- | ---: |\n{lines}"


def bench_transformers(config_dict: dict, prompt: int = 128, new: int = 64) -> float:
    """transformers' GptOssForCausalLM (bf16 weights, eager attention, generate), batch 1."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**{k: v for k, v in config_dict.items() if k != "quantization_config"})
    with torch.device("cuda"):
        hf = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    hf.config._attn_implementation = "eager"
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device="cuda")
    hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    rate = new / (time.perf_counter() - t0)
    del hf
    torch.cuda.empty_cache()
    return rate


class ReplayDrafter:
    """Proposes a known continuation (the plain run's output): what a perfect drafter would guess."""

    aux_layers: tuple[int, ...] = ()
    writes_ahead = False

    def __init__(self, continuation: list[int]):
        self.continuation = continuation

    def kv_bytes_per_page(self, page_size: int) -> int:
        return 0

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        pass

    def propose(self, ctx: DraftContext) -> list[list[int]]:
        return [self.continuation[s.num_output_tokens : s.num_output_tokens + n] for s, n in zip(ctx.seqs, ctx.limit)]


def bench_speculative(model, args) -> dict:
    """Batch-1 engine decode on a repetitive prompt: plain, with the drafter, with replayed drafts."""
    import random

    from inference.config import EngineConfig
    from inference.engine.core import LLMEngine
    from inference.request import GenerationRequest, SamplingParams

    def sync() -> None:
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    rng = random.Random(0)
    words = [rng.randrange(200_000) for _ in range(args.spec_words or 64)]
    prompt = [rng.choice(words) for _ in range(64)] * 8  # a 64-token block, 8 times
    bias = {w: 20.0 - 2.0 * i for i, w in enumerate(words)} if args.spec_words else {}
    max_len = len(prompt) + args.spec_tokens + 64
    draft_model = args.draft_model
    if args.speculative == "eagle3" and draft_model is None:
        from inference.spec_decode.eagle3 import write_random_eagle3_checkpoint

        draft_model = str(
            write_random_eagle3_checkpoint(
                Path("/tmp/oss-agent-bench-eagle3"),
                model.config,
                draft_token_ids=sorted(words),
                draft_vocab_size=len(words),
            )
        )
        progress("no --draft-model: a random EAGLE-3 draft head (its guesses are rarely right)")

    def timed(label: str, replay: list[int] | None = None, **spec) -> tuple[list[int], float, float]:
        eng = LLMEngine(
            model,
            EngineConfig(
                num_pages=-(-max_len // args.page_size) + 8,
                max_model_len=max_len,
                max_num_seqs=1,
                page_size=args.page_size,
                **spec,
            ),
        )
        if replay is not None:
            eng.drafter = ReplayDrafter(replay)
        params = SamplingParams(temperature=0.0, max_tokens=args.spec_tokens, logit_bias=bias)
        for attempt in ("warm-up", "timed"):
            eng.add_request(GenerationRequest(attempt, prompt, params))
            out: list[int] = []
            start = None
            before = eng.stats()
            while eng.has_unfinished():
                for d in eng.step():
                    out.extend(d.token_ids)
                if start is None and out:  # the prefill step is done: time decode only
                    sync()
                    start, first = time.perf_counter(), len(out)
            sync()
            seconds = time.perf_counter() - start
        after = eng.stats()
        steps = after.spec_steps - before.spec_steps
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        length = (steps + accepted) / steps if steps else 0.0
        rate = (len(out) - first) / seconds
        progress(f"{label}: {rate:,.0f} tok/s, mean acceptance length {length:.2f}")
        del eng
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        return out, rate, length

    spec = dict(speculative=args.speculative, num_draft_tokens=args.num_draft_tokens, draft_model=draft_model)
    plain, plain_rate, _ = timed("without speculation")
    ours, rate, length = timed(f"{args.speculative}, k={args.num_draft_tokens}", **spec)
    _, replay_rate, replay_length = timed(
        "replayed drafts", replay=plain, speculative="ngram", num_draft_tokens=args.num_draft_tokens
    )
    same = next((i for i, (a, b) in enumerate(zip(ours, plain)) if a != b), len(plain))
    return {
        "prompt_tokens": len(prompt),
        "new_tokens": args.spec_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "method": args.speculative,
        "confined_to_words": args.spec_words,
        "plain_tok_s": plain_rate,
        "spec_tok_s": rate,
        "spec_mean_acceptance_length": length,
        "replay_tok_s": replay_rate,
        "replay_mean_acceptance_length": replay_length,
        "identical_prefix_tokens": same,
    }


def decode_max_len(args) -> int:
    """A sequence's prompt (`args.context` tokens) plus room to decode: what the engine's
    sequences and the static batches are sized for."""
    return args.context + 2 * args.steps + 32


def decode_pages_per_seq(args) -> int:
    """Pages a sequence of `decode_max_len(args)` tokens takes."""
    return -(-decode_max_len(args) // args.page_size)


def decode_engine(model, args, max_seqs: int):
    """An engine with async scheduling for `max_seqs` sequences of `decode_max_len(args)` tokens."""
    from inference.config import EngineConfig
    from inference.engine.core import LLMEngine

    # StaticBatch (the graph-replay row) lays every sequence's pages out in both pools alike.
    pages = max_seqs * decode_pages_per_seq(args) + 8
    return LLMEngine(
        model,
        EngineConfig(
            num_pages=pages,
            num_sliding_pages=pages,
            max_model_len=decode_max_len(args),
            max_num_seqs=max_seqs,
            page_size=args.page_size,
            async_scheduling=True,
            # Every prompt is prefilled before the clock: uncapped, so that all start decoding
            # together and none reaches max_tokens inside the timed window.
            max_prefill_tokens_decoding=None,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
    )


def start_decoding(engine, model, args, ids: list[str], rng) -> None:
    """Add a random `args.context`-token greedy request per id; step until every prefill is done
    and a few decode steps ran (so async scheduling is under way)."""
    from inference.request import GenerationRequest, SamplingParams

    for rid in ids:
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(args.context)]
        engine.add_request(GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=args.steps + 24)))
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < 4:
        for d in engine.step():
            produced[d.request_id] += len(d.token_ids)
    torch.cuda.synchronize()


def engine_timeline(model, args, batch: int):
    """`step_timeline.Timeline` of `args.steps` async engine decode steps at `batch` sequences."""
    import os
    import random
    import tempfile

    from step_timeline import load_activities, timeline
    from torch.profiler import ProfilerActivity, profile

    engine = decode_engine(model, args, batch)
    start_decoding(engine, model, args, [f"timeline-{i}" for i in range(batch)], random.Random(0))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        activities = load_activities(path)
    return timeline(activities, args.steps)


def bench_async_scheduling(model, args) -> dict:
    """Decode through the engine at each batch size: graph replay alone, engine with async
    scheduling off, and on. Returns {batch: {graph_tok_s, sync_tok_s, async_tok_s, sync_host_us,
    async_host_us}}."""
    import random

    from inference import transfers

    batches = [int(b) for b in args.batches.split(",")]
    pages_per_seq = decode_pages_per_seq(args)
    engine = decode_engine(model, args, max(batches))
    overlap, graphs = engine.overlap, engine.runner.graphs

    waited = [0.0]  # seconds the engine thread spent waiting for sampled ids to reach the host
    real_get = transfers.HostCopy.get

    def timed_get(self):
        t0 = time.perf_counter()
        try:
            return real_get(self)
        finally:
            waited[0] += time.perf_counter() - t0

    transfers.HostCopy.get = timed_get
    rng = random.Random(0)
    results = {}
    try:
        # Unmeasured: the first replays after a build compile and tune kernels on the host.
        bench_decode(model, engine.kv_caches, graphs, batches[0], args.context, 4, pages_per_seq, args.page_size)
        for b in batches:
            row = results[b] = {}
            progress(f"batch {b}: graph replay alone")
            row["graph_tok_s"] = bench_decode(
                model, engine.kv_caches, graphs, b, args.context, args.steps, pages_per_seq, args.page_size
            )
            for mode in ("sync", "async"):
                progress(f"batch {b}: engine, async scheduling {'on' if mode == 'async' else 'off'}")
                engine.overlap = overlap if mode == "async" else None
                ids = [f"{mode}-{b}-{i}" for i in range(b)]
                start_decoding(engine, model, args, ids, rng)
                waited[0], tokens, t0 = 0.0, 0, time.perf_counter()
                for _ in range(args.steps):
                    tokens += sum(len(d.token_ids) for d in engine.step())
                # Async: the step left in flight ran partly inside the window, the one collected
                # first ran before it; waiting for it here counts as many GPU steps as token steps.
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                row[f"{mode}_tok_s"] = tokens / seconds
                row[f"{mode}_host_us"] = (seconds - waited[0]) / args.steps * 1e6
                for rid in ids:
                    engine.abort(rid)
                while engine.has_unfinished():  # collect a step still in flight
                    engine.step()
                torch.cuda.synchronize()
    finally:
        transfers.HostCopy.get = real_get
    return results


# A typical structured-output schema; its arrays and strings are open, so a random model stays
# inside it for the whole timed window (the row stays constrained).
CONSTRAINED_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "status": {"enum": ["active", "inactive", "pending"]},
                },
                "required": ["id", "name", "price", "tags", "status"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["items"],
    "additionalProperties": False,
}


def bench_constrained(model, args) -> dict:
    """Decode through the engine at each batch size, all rows free, then one row held to
    CONSTRAINED_SCHEMA. Returns {batch: {free_tok_s, mixed_tok_s, mixed_free_rows_tok_s,
    constrained_active}}."""
    import random

    from inference.config import EngineConfig
    from inference.engine.core import LLMEngine
    from inference.grammar import Grammar
    from inference.request import GenerationRequest, SamplingParams

    device = model.device
    batches = [int(b) for b in args.batches.split(",")]
    pages = max(batches) * decode_pages_per_seq(args) + 8
    engine = LLMEngine(
        model,
        EngineConfig(
            num_pages=pages,
            num_sliding_pages=pages,
            max_model_len=decode_max_len(args),
            max_num_seqs=max(batches),
            page_size=args.page_size,
            async_scheduling=device.type == "cuda",
            max_prefill_tokens_decoding=None,  # as in `decode_engine`
        ),
    )
    grammar = Grammar.json_schema(CONSTRAINED_SCHEMA)
    engine.grammars.compile(grammar, [])  # the vocabulary's tables and this grammar, before timing

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    rng = random.Random(0)
    results = {}
    for b in batches:
        row = results[b] = {}
        for mode in ("free", "mixed"):
            progress(f"batch {b}: {'one constrained request' if mode == 'mixed' else 'every request free'}")
            ids = [f"{mode}-{b}-{i}" for i in range(b)]
            constrained = ids[0] if mode == "mixed" else None
            for rid in ids:
                prompt = [rng.randrange(200_000) for _ in range(args.context)]
                engine.add_request(
                    GenerationRequest(
                        rid,
                        prompt,
                        SamplingParams(
                            temperature=0.0, max_tokens=args.steps + 24, grammar=grammar if rid == constrained else None
                        ),
                    )
                )
            produced = dict.fromkeys(ids, 0)
            while min(produced.values()) < 4:  # every prefill done, decoding under way
                for d in engine.step():
                    produced[d.request_id] += len(d.token_ids)
            sync()
            counts, t0 = dict.fromkeys(ids, 0), time.perf_counter()
            for _ in range(args.steps):
                for d in engine.step():
                    counts[d.request_id] += len(d.token_ids)
            sync()
            seconds = time.perf_counter() - t0
            row[f"{mode}_tok_s"] = sum(counts.values()) / seconds
            if mode == "mixed":
                row["mixed_free_rows_tok_s"] = sum(n for rid, n in counts.items() if rid != constrained) / seconds
                live = engine.scheduler.find(constrained)
                row["constrained_active"] = live is not None and counts[constrained] > 0
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            sync()
        row["free_rows_per_row_ratio"] = (
            (row["mixed_free_rows_tok_s"] / max(b - 1, 1)) / (row["free_tok_s"] / b) if b > 1 else None
        )
    engine.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        choices=[*GPT_OSS_SHAPES, "tiny"],
        default="20b",
        help="gpt-oss shapes (tiny: the test checkpoint's, for --constrained on CPU)",
    )
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (only with --constrained)")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--prefill",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[2048],
        help="prompt lengths to time prefill at (comma-separated; empty: none)",
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="the KV cache's dtype (`EngineConfig.kv_cache_dtype`; the roofline counts its bytes)",
    )
    ap.add_argument("--attention", default=None, help="attention backend (default: best available)")
    ap.add_argument("--moe", default=None, help="MoE backend (default: best available)")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode (for comparison)")
    ap.add_argument(
        "--profile",
        nargs="?",
        const="1",
        default="",
        help="print a per-kernel breakdown of one step at these batches (default 1)",
    )
    ap.add_argument(
        "--mixed-prompt",
        type=int,
        default=0,
        metavar="TOKENS",
        help="with --profile: the profiled steps also take a joining prompt of this many tokens, and the "
        "script sums the kernel time of the decode rows alone, the prompt alone and both in one step",
    )
    ap.add_argument("--hf", action="store_true", help="also time transformers on the same shapes")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--speculative",
        choices=["ngram", "eagle3"],
        help="time batch-1 engine decode with and without this drafter instead",
    )
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft-model", help="EAGLE-3 draft checkpoint (default for eagle3: a random one)")
    ap.add_argument("--spec-tokens", type=int, default=256, help="tokens to generate per speculative run")
    ap.add_argument(
        "--spec-words",
        type=int,
        default=8,
        help="distinct words of the repetitive prompt; the output is confined to them (0: no bias)",
    )
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="time decode through the engine at --batches with async scheduling off and on instead",
    )
    ap.add_argument(
        "--constrained",
        action="store_true",
        help="time engine decode at --batches with every request free, then with one held to a JSON schema, instead",
    )
    ap.add_argument(
        "--timeline",
        type=int,
        metavar="BATCH",
        help="instead profile --steps engine decode steps (async scheduling) at this batch and "
        "print their kernel timeline: busy time, span, gaps between kernels",
    )
    args = ap.parse_args()
    if args.constrained:
        run_constrained(args)
        return
    if args.model == "tiny" or args.device != "cuda":
        ap.error("--model tiny and --device cpu run only with --constrained")

    torch.backends.cuda.matmul.allow_tf32 = True
    gpu = torch.cuda.get_device_name()
    progress(f"device {gpu}; measuring copy bandwidth and the bf16 matmul rate")
    bandwidth, flop_rate = copy_bandwidth(), matmul_rate()
    raw = hf_config_dict(GPT_OSS_SHAPES[args.model])
    config = ModelConfig.from_dict(raw)

    batches = [int(b) for b in args.batches.split(",")]
    kv_element = 1 if args.kv_cache_dtype == "fp8" else 2
    rooflines = {b: roofline_tok_s(config, b, args.context, bandwidth, flop_rate, kv_element) for b in batches}

    def roofline_note(batch: int, rate: float) -> str:
        bound, binds = rooflines[batch]
        return f"{bound:,.0f} ({binds}) | {rate / bound:.0%}"

    ceilings = (
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flop_rate / 1e12:.0f} TFLOP/s (measured); "
        "roofline: a step's bytes (weights, the experts the batch touches, KV) at the copy bandwidth or its "
        "FLOPs at the matmul rate, whichever takes longer"
    )
    max_context = args.context + args.steps + 8 + (32 if args.profile else 0)  # --profile's steps advance too
    pages_per_seq = -(-max([max_context, *args.prefill]) // args.page_size)
    if args.timeline:
        from step_timeline import format_timeline

        progress(f"building gpt-oss-{args.model} with random weights on the GPU")
        model = GptOssModel.from_random(
            config,
            device="cuda",
            attention_backend=args.attention,
            moe_backend=args.moe,
            max_positions=decode_max_len(args) + 32,
        )
        progress(f"profiling {args.steps} engine steps at batch {args.timeline}")
        print(
            format_timeline(
                engine_timeline(model, args, args.timeline),
                f"gpt-oss-{args.model} random weights on {gpu}; engine decode, async scheduling, "
                f"batch {args.timeline}, ~{args.context} tokens of context",
            )
        )
        return
    if args.async_scheduling:
        progress(f"building gpt-oss-{args.model} with random weights on the GPU")
        model = GptOssModel.from_random(
            config,
            device="cuda",
            attention_backend=args.attention,
            moe_backend=args.moe,
            max_positions=decode_max_len(args) + 32,
        )
        rows = bench_async_scheduling(model, args)
        print(
            f"\ngpt-oss-{args.model} random weights on {gpu}; decode through the engine, greedy, every sequence "
            f"at ~{args.context} tokens of context; {args.steps} timed steps"
        )
        print(ceilings)
        print(
            "\n| batch | graph replay alone tok/s | engine sync tok/s | engine async tok/s | async / sync "
            "| host µs/step sync | host µs/step async | async step ms | roofline tok/s | async / roofline |"
            "\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        )
        for b, r in rows.items():
            print(
                f"| {b} | {r['graph_tok_s']:,.0f} | {r['sync_tok_s']:,.0f} | {r['async_tok_s']:,.0f} | "
                f"{r['async_tok_s'] / r['sync_tok_s']:.2f}x | {r['sync_host_us']:,.0f} | {r['async_host_us']:,.0f} | "
                f"{1e3 * b / r['async_tok_s']:.2f} | {roofline_note(b, r['async_tok_s'])} |"
            )
            r["roofline_tok_s"], r["roofline_bound"] = rooflines[b]
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "device": gpu,
                        "model": args.model,
                        "context": args.context,
                        "date": time.strftime("%Y-%m-%d"),
                        "decode": rows,
                    },
                    indent=2,
                )
            )
        return
    if args.speculative:
        progress(f"building gpt-oss-{args.model} with random weights on the GPU")
        model = GptOssModel.from_random(
            config, device="cuda", attention_backend=args.attention, moe_backend=args.moe, max_positions=4096
        )
        r = bench_speculative(model, args)
        r.update(device=gpu, model=args.model, date=time.strftime("%Y-%m-%d"), copy_bandwidth_TBps=bandwidth / 1e12)
        print(
            f"\ngpt-oss-{args.model} random weights on {gpu}; batch 1, {r['prompt_tokens']}-token repetitive "
            f"prompt, {r['new_tokens']} new tokens, greedy"
            + (f", output confined to the prompt's {args.spec_words} words by a logit bias" if args.spec_words else "")
        )
        print("\n| decode, batch 1 | tok/s | mean acceptance length | speed-up |\n| --- | ---: | ---: | ---: |")
        print(f"| without speculation | {r['plain_tok_s']:,.0f} | | |")
        print(
            f"| {args.speculative}, {args.num_draft_tokens} draft tokens | {r['spec_tok_s']:,.0f} | "
            f"{r['spec_mean_acceptance_length']:.2f} | {r['spec_tok_s'] / r['plain_tok_s']:.2f}x |"
        )
        print(
            f"| replayed drafts (a perfect drafter) | {r['replay_tok_s']:,.0f} | "
            f"{r['replay_mean_acceptance_length']:.2f} | {r['replay_tok_s'] / r['plain_tok_s']:.2f}x |"
        )
        print(
            f"\nwith and without drafts the greedy outputs agree on the first {r['identical_prefix_tokens']} "
            f"of {r['new_tokens']} tokens (bf16 rounding differs between decode and verification steps)"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=2))
        return
    progress(f"building gpt-oss-{args.model} with random weights on the GPU")
    model = GptOssModel.from_random(
        config,
        device="cuda",
        attention_backend=args.attention,
        moe_backend=args.moe,
        max_positions=max([max_context, *args.prefill]) + 16,
    )
    torch.cuda.synchronize()
    weights_bytes = torch.cuda.memory_allocated()
    profile_batches = [int(b) for b in args.profile.split(",") if b]
    num_pages = max(batches + profile_batches) * pages_per_seq + -(-args.mixed_prompt // args.page_size)
    shape = (num_pages, args.page_size, config.num_key_value_heads, config.head_dim)
    progress(f"allocating KV cache: {num_pages} pages x {config.num_hidden_layers} layers")
    kv_caches = []
    kv_dtype = FP8_KV_DTYPE if args.kv_cache_dtype == "fp8" else torch.bfloat16
    for _ in range(config.num_hidden_layers):
        k = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.5
        kv_caches.append((k.to(kv_dtype), torch.randn_like(k).to(kv_dtype)))
    runner = DecodeGraphRunner(model, kv_caches, pages_per_seq, max_context, batch_sizes=tuple(batches))
    if not args.no_graphs:
        progress(f"capturing CUDA graphs for batch sizes {batches}")
        runner.capture()
    else:
        runner.run = lambda ids, meta: (model.compute_logits(model(ids, meta, kv_caches)), None)  # type: ignore[method-assign]

    parts = bytes_per_token(config, args.context, kv_element)
    roofline = bandwidth / sum(parts.values())
    results = {
        "device": gpu,
        "model": args.model,
        "date": time.strftime("%Y-%m-%d"),
        "attention_backend": type(model.attention_backend).__name__,
        "moe_backend": type(model.moe_backend).__name__,
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "matmul_TFLOPs": flop_rate / 1e12,
        "roofline_tok_s": {b: bound for b, (bound, _) in rooflines.items()},
        "bytes_per_token_GB": sum(parts.values()) / 1e9,
        "roofline_batch1_tok_s": roofline,
        "context": args.context,
        "decode": {},
        **kv_capacity(config, weights_bytes, kv_element),
    }
    for b in batches:
        progress(f"decode batch {b}")
        results["decode"][b] = bench_decode(
            model, kv_caches, runner, b, args.context, args.steps, pages_per_seq, args.page_size
        )
    results["prefill_tok_s"] = {}
    for tokens in args.prefill:
        progress(f"prefill {tokens} tokens")
        results["prefill_tok_s"][tokens] = bench_prefill(model, kv_caches, tokens, args.page_size)

    print(
        f"\ngpt-oss-{args.model} random weights on {gpu}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
        f"attention={results['attention_backend']} moe={results['moe_backend']}"
    )
    print(
        f"bytes per batch-1 token at {args.context} context: {sum(parts.values()) / 1e9:.2f} GB "
        f"({', '.join(f'{k} {v / 1e9:.2f}' for k, v in parts.items())}); roofline {roofline:.0f} tok/s\n"
    )
    print(
        f"memory: weights {weights_bytes / 1e9:.1f} GB on the GPU (measured); at "
        f"{results['kv_bytes_per_token']:,} KV bytes a token, an 80 GB H100 at 0.9 utilisation holds "
        f"{results['kv_tokens_h100_80gb']:,} tokens of cache beside them (computed, {ACTIVATION_RESERVE / 1e9:.0f} GB "
        f"kept for activations)\n"
    )
    print(ceilings + "\n")
    print("| measure | tok/s | step ms | roofline tok/s | of roofline |\n| --- | ---: | ---: | ---: | ---: |")
    for b, rate in results["decode"].items():
        print(
            f"| decode batch {b}, context {args.context} | {rate:,.0f} | {1e3 * b / rate:.2f} | {roofline_note(b, rate)} |"
        )
    for tokens, rate in results["prefill_tok_s"].items():
        print(f"| prefill, {tokens}-token prompt | {rate:,.0f} | | | |")
    for batch in profile_batches:
        joining = f" beside a joining {args.mixed_prompt}-token prompt" if args.mixed_prompt else ""
        print(f"\nper-kernel breakdown of one eager batch-{batch} decode step{joining}:\n")
        print(profile_step(model, kv_caches, batch, args.context, pages_per_seq, args.page_size, args.mixed_prompt))
    if args.hf:
        del model, kv_caches, runner
        torch.cuda.empty_cache()
        progress("transformers GptOssForCausalLM, same shapes")
        results["transformers_tok_s"] = rate_hf = bench_transformers(raw)
        ours = results["decode"].get(1)
        ratio = f"; ours / transformers = {ours / rate_hf:.1f}x" if ours else ""
        print(f"\ntransformers batch 1 (bf16, eager, generate): {rate_hf:.1f} tok/s{ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def run_constrained(args) -> None:
    raw = hf_config_dict() if args.model == "tiny" else hf_config_dict(GPT_OSS_SHAPES[args.model])
    config = ModelConfig.from_dict(raw)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    progress(f"building gpt-oss-{args.model} with random weights on {where}")
    model = GptOssModel.from_random(
        config,
        device=args.device,
        attention_backend=args.attention,
        moe_backend=args.moe,
        max_positions=decode_max_len(args) + 32,
    )
    rows = bench_constrained(model, args)
    print(
        f"\ngpt-oss-{args.model} random weights on {where}; decode through the engine, greedy, every sequence at "
        f"~{args.context} tokens of context; {args.steps} timed steps; async scheduling "
        f"{'on' if args.device == 'cuda' else 'off'}"
    )
    print(
        "\n| batch | all free tok/s | one constrained: batch tok/s | its free rows tok/s | free rows, per row "
        "vs all free | constrained row still running |\n| ---: | ---: | ---: | ---: | ---: | --- |"
    )
    for b, r in rows.items():
        ratio = f"{r['free_rows_per_row_ratio']:.3f}" if r["free_rows_per_row_ratio"] is not None else "n/a"
        print(
            f"| {b} | {r['free_tok_s']:,.0f} | {r['mixed_tok_s']:,.0f} | {r['mixed_free_rows_tok_s']:,.0f} | "
            f"{ratio} | {'yes' if r['constrained_active'] else 'no'} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": where,
                    "model": args.model,
                    "context": args.context,
                    "date": time.strftime("%Y-%m-%d"),
                    "decode": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
