"""CUDA graphs for decode steps: capture the whole model once per batch size, replay per token.
(And for the other steps of a few hundred tokens, prefill chunks and requests joining a batch:
`PrefillGraphRunner`, at the end.)

At batch 1 a gpt-oss step is ~100 kernel launches of a few microseconds each; launching them
from Python costs more than running them. A captured graph replays them with one launch.

A graph is captured per (batch size, tokens per sequence): 1 token for plain decode, and with
speculative decoding k + 1 for a step that verifies k drafts per sequence (that step goes
through the extend attention kernel, which is capture-safe too: its tile count depends only on
the shape). Each owns static input buffers (token ids, positions, slot mappings, context
lengths, block tables). `run` writes the step's real values into the smallest captured batch that
fits and pads the rest with harmless sequences (slot -1: no KV write; context = tokens per
sequence, on page 0), all in one launch (`inference/runner/graph_inputs_triton.py`), replays,
and returns the real rows' logits (and the target layer outputs an EAGLE-3 drafter reads, when
asked for). Larger batches run eagerly. The number of real tokens goes into the graph too
(`valid_tokens`): the MoE routes the padding rows to no expert, so a step of 5 sequences in the
graph of 8 reads the experts of 5 tokens, not 8.

The attention and MoE backends must be capture-safe in decode: no host synchronisation and no
dependence on the metadata's Python lists beyond their length (the lists passed at capture
hold upper bounds: every context is `max_context`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference.model.gpt_oss import GptOssModel
from inference.ops.attention.reference import AttentionMetadata, DecodePrefix, leading_decode_rows
from inference.runner.graph_inputs_triton import KINDS, GraphInputs, StepValues, fill_graph_inputs
from inference.runner.vocab_parallel import vocab_parallel_argmax

log = logging.getLogger(__name__)

# Decode graphs are captured up to the smallest size holding `max_num_seqs` (512 by default).
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


@dataclass
class _Captured:
    """A graph's static buffers (decode: B sequences of Q tokens; prefill: Q tokens in all of up to
    B sequences, where B is `PrefillGraphRunner.max_seqs`)."""

    input_ids: torch.Tensor  # [B*Q] int64 (Q tokens per sequence)
    positions: torch.Tensor  # [B*Q] int64
    slots: dict[str, torch.Tensor]  # [B*Q] int64 per cache kind; -1: no KV write
    context_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32, fixed: Q per sequence (the graph reads it: keep it alive)
    block_tables: dict[str, torch.Tensor]  # [B, P] int32 per cache kind
    graph: torch.cuda.CUDAGraph | None = None  # set by `record_graph`
    # [B*Q, V] (prefill: [R, V], see `row`) float32, written by the graph; under tensor parallelism
    # this rank's vocabulary shard [B*Q, V/N] in the model's dtype, and `greedy_ids` [B*Q] the
    # greedy tokens (`inference/runner/vocab_parallel.py`)
    logits: torch.Tensor | None = None
    greedy_ids: torch.Tensor | None = None
    aux: torch.Tensor | None = None  # [B*Q, A] aux layer outputs, written by the graph
    row: torch.Tensor | None = None  # prefill: [R] int64, the rows whose logits the graph returns
    # [1] int32: the step's real tokens (the rest are padding, which the MoE routes nowhere)
    valid_tokens: torch.Tensor | None = None
    decode_prefix: DecodePrefix | None = None  # prefill: where the step's decode rows are

    def inputs(self) -> GraphInputs:
        """The static buffers `fill_graph_inputs` writes before a replay."""
        return GraphInputs(
            self.input_ids, self.positions, self.slots, self.context_lens, self.block_tables, self.valid_tokens
        )


def record_graph(step, pool=None, warmups: int = 2):
    """Run `step` `warmups` times (Triton compiles and autotunes there, outside the graph), then
    capture it into a new graph sharing memory `pool` (None: a pool of its own). Returns (graph,
    what `step` returned during capture: the graph's output buffers). The benchmarks time their
    graphs through this function too, so that they replay what the engine replays.

    The warm-up runs on the current stream, not on a side stream as PyTorch's recipe has it (for
    autograd and DDP state, which inference has none of). On an H200 the two gave the same engine
    tok/s, but `experiments/pdl_chain.py`'s chain, warmed up on a side stream, replayed every
    ordinary launch boundary 0.7 us slower and every dependent one 0.2 us slower, wherever it was
    captured (docs/benchmark-log.md)."""
    for _ in range(warmups):
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=capture_stream()):  # (synchronises first)
        out = step()
    return graph, out


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """A side stream of the current device to capture on. `torch.cuda.graph`'s default is one
    stream for the whole process, made on whichever device was current at the first capture:
    an engine on another GPU would capture on it, its launches going to the first GPU."""
    index = torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


class DecodeGraphRunner:
    """Captured decode steps for one model and one set of KV caches.

    kv_caches: the per-layer (k_cache, v_cache) the engine allocated; max_pages: block-table width;
    max_context: the longest context any sequence may reach (bounds split-K work in attention).
    tokens_per_seq: the step shapes to capture (1: decode; k + 1: verify k drafts each);
    verification graphs are captured for batch sizes up to `max_verify_batch` only.
    aux_layers: target layers whose outputs each step also returns (for an EAGLE-3 drafter).
    """

    def __init__(
        self,
        model: GptOssModel,
        kv_caches: list,
        max_pages: int,
        max_context: int,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        max_batch: int | None = None,
        tokens_per_seq: tuple[int, ...] = (1,),
        max_verify_batch: int = 32,
        aux_layers: tuple[int, ...] = (),
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.max_pages = max_pages
        self.max_context = max_context
        self.aux_layers = tuple(aux_layers)
        # Up to the smallest size that holds max_batch sequences (a batch of 5 replays the graph
        # of 8; its padding costs no expert reads, see `valid_tokens`).
        limit = max_batch or max(batch_sizes)
        cover = min((b for b in batch_sizes if b >= limit), default=max(batch_sizes))
        self.batch_sizes = tuple(sorted(b for b in batch_sizes if b <= cover))
        # Per tokens-per-sequence shape, the captured batch sizes (ascending).
        self.sizes: dict[int, tuple[int, ...]] = {
            q: self.batch_sizes if q == 1 else tuple(b for b in self.batch_sizes if b <= max_verify_batch)
            for q in tokens_per_seq
        }
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = None

    def capture(self) -> None:
        """Capture every shape, largest first so smaller graphs reuse its memory pool."""
        shapes = sorted(((b, q) for q, sizes in self.sizes.items() for b in sizes), key=lambda s: -s[0] * s[1])
        for b, q in shapes:
            self.graphs[(b, q)] = self._capture_one(b, q)
        log.info("captured CUDA graphs", extra={"batch_sizes": {q: list(s) for q, s in self.sizes.items()}})

    def _capture_one(self, b: int, q: int = 1) -> _Captured:
        dev = self.model.device
        t = b * q
        buf = _Captured(
            input_ids=torch.zeros(t, dtype=torch.long, device=dev),
            positions=torch.zeros(t, dtype=torch.long, device=dev),
            slots={k: torch.full((t,), -1, dtype=torch.long, device=dev) for k in KINDS},
            context_lens=torch.full((b,), q, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=dev) * q,
            block_tables={k: torch.zeros(b, self.max_pages, dtype=torch.int32, device=dev) for k in KINDS},
            valid_tokens=torch.full((1,), t, dtype=torch.int32, device=dev) if self.pads(b, q) else None,
        )
        meta = self._metadata(buf, b, q)
        self._warm_up_fill(buf, b, q)
        buf.graph, (buf.logits, buf.aux, buf.greedy_ids) = record_graph(lambda: self._step(buf, meta), self.pool)
        self.pool = buf.graph.pool()
        return buf

    def pads(self, b: int, q: int = 1) -> bool:
        """Whether the graph of b sequences (of q tokens) also runs smaller batches, padded. Only
        those graphs carry the count of real tokens: at batch 1 the MoE's load of it would sit
        on every layer's critical path for nothing."""
        return b - max((s for s in self.sizes[q] if s < b), default=0) > 1

    @staticmethod
    def _warm_up_fill(buf: _Captured, b: int, q: int) -> None:
        """Compile `run`'s input kernel for this shape now, not on a served step: a step of b
        sequences at position 0 (what the buffers hold already), without the gather of the
        previous ids and, for plain decode (the only steps async scheduling chains), with it."""
        dev = buf.input_ids.device
        t = b * q
        step = StepValues(
            torch.zeros(t, dtype=torch.long, device=dev),
            torch.zeros(t, dtype=torch.long, device=dev),
            {k: torch.full((t,), -1, dtype=torch.long, device=dev) for k in KINDS},
            torch.full((b,), q, dtype=torch.int32, device=dev),
            {k: torch.zeros(b, 1, dtype=torch.int32, device=dev) for k in KINDS},
        )
        fill_graph_inputs(buf.inputs(), step, q)
        if q == 1:
            step.previous = torch.zeros(1, dtype=torch.long, device=dev)
            fill_graph_inputs(buf.inputs(), step, q)

    def _metadata(self, buf: _Captured, b: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=buf.cu_seqlens_q,
            context_lens=buf.context_lens,
            block_tables=buf.block_tables,
            slot_mapping=buf.slots,
            positions=buf.positions,
            max_q_len=q,
            q_lens=[q] * b,
            context_lens_list=[self.max_context] * b,
        )

    def _step(self, buf: _Captured, meta: AttentionMetadata):
        """(logits, aux or None, greedy ids or None): see `_Captured`. Under tensor parallelism
        the graph stops at this rank's logits shard and the greedy tokens; `execute` gathers the
        whole logits only for steps that need them."""
        aux = None
        if self.aux_layers:
            hidden, aux = self.model(
                buf.input_ids, meta, self.kv_caches, aux_layers=self.aux_layers, valid_tokens=buf.valid_tokens
            )
        else:
            hidden = self.model(buf.input_ids, meta, self.kv_caches, valid_tokens=buf.valid_tokens)
        if self.model.tp is None:
            return self.model.compute_logits(hidden), aux, None
        shard = self.model.logits_shard(hidden)
        return shard, aux, vocab_parallel_argmax(self.model.tp, shard)

    def can_run(self, batch: int, tokens_per_seq: int = 1) -> bool:
        sizes = self.sizes.get(tokens_per_seq)
        return bool(self.graphs) and bool(sizes) and batch <= sizes[-1]

    def run(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        tokens_per_seq: int = 1,
        previous: torch.Tensor | None = None,
    ):
        """A step where each of B sequences runs `tokens_per_seq` new tokens (len(input_ids) = B * that).
        previous: if given, input_ids are rows of it (the previous step's sampled ids, on the device).

        Returns (logits [B * tokens_per_seq, V], aux [B * tokens_per_seq, A] or None, greedy ids
        or None): the graph's output buffers (see `_Captured`), so read them before the next `run`.
        """
        q = tokens_per_seq
        t = input_ids.shape[0]
        n = t // q
        size = next(b for b in self.sizes[q] if b >= n)
        buf = self.graphs[(size, q)]
        fill_graph_inputs(
            buf.inputs(),
            StepValues(input_ids, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables, previous),
            q,
        )
        buf.graph.replay()
        return (
            buf.logits[:t],
            (buf.aux[:t] if buf.aux is not None else None),
            (buf.greedy_ids[:t] if buf.greedy_ids is not None else None),
        )

    def release(self) -> None:
        """Free the captured graphs (they hold the collectives they captured)."""
        for captured in self.graphs.values():
            captured.graph.reset()
        self.graphs.clear()
        self.pool = None


# Tokens a step graph is captured for (a step's tokens are padded up to the next). 384 splits the
# widest gap below 512: a 323-token prompt took 9.4-9.7 ms in it against 9.8-10.3 in 512's (20b,
# H200); 48, 96 and 192 measured no gain. 640 to 1024 hold the steps where requests join a running
# batch (63 decode rows and a prompt: 260-520 tokens at 64 streams). Each graph costs about 1.6 s
# of capture at start-up.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 1024)
# Sequences a step graph holds (real ones, and one more for the padding): every step of up to
# 256 sequences where requests join running ones. Such a step's decode rows take the decode kernel as eagerly
# (`DecodePrefix`). At 256 streams against graphs of 128 sequences, which left those steps eager
# (20 ms of launches on the host): 14,433 against 13,682 output tok/s and ITL p99 31.8 against
# 47.2 ms (20b, H200, docs/benchmark-log.md). A lone prompt pays for the wider graph: twice the
# attention programs and longer scans of the sequence slots cost it 0.18 ms, measured before the
# decode kernel's launch (its programs find no context and return) joined each layer.
PREFILL_GRAPH_SEQS = 257
# Past 1024 tokens, buckets every MIXED_BUCKET_STEP tokens up to the steps where a prefill chunk
# capped at `max_prefill_tokens_decoding` joins a batch the graphs hold.
MIXED_BUCKET_STEP = 128
MAX_STEP_GRAPH_TOKENS = 2048  # larger steps are prefill-heavy: their kernels outlast their launches


def step_graph_buckets(max_num_seqs: int, max_prefill_tokens_decoding: int | None) -> tuple[int, ...]:
    """Token buckets of the step graphs for an engine that runs at most `max_num_seqs` sequences
    and prefills at most `max_prefill_tokens_decoding` tokens a step while any of them decodes
    (None: no cap, and no buckets past 1024: a joining prompt may then take the whole budget).
    A capped chunk beside up to 256 decode rows then replays a graph instead of ~270 eager
    launches: at 64 streams and 1,024-token chunks, mean TTFT fell from 366-385 ms to 320-323
    (H200, docs/benchmark-log.md)."""
    buckets = list(PREFILL_BUCKETS)
    if max_prefill_tokens_decoding is not None:
        rows = min(max_num_seqs, PREFILL_GRAPH_SEQS - 1)
        mixed = min(rows + max_prefill_tokens_decoding, MAX_STEP_GRAPH_TOKENS)
        while buckets[-1] < mixed:
            buckets.append(buckets[-1] + MIXED_BUCKET_STEP)
    return tuple(buckets)


class PrefillGraphRunner:
    """Captured steps that are not plain decode: up to `max_seqs` - 1 sequences with Q new tokens
    in all, one graph per Q bucket (`PREFILL_BUCKETS`). That is a prompt's prefill (chunk), or a
    running batch's decode rows beside the prompts of requests joining it.

    An eager step is ~270 launches; where each costs tens of microseconds of host time (50 under
    gVisor), a step of a few hundred tokens is host-bound: 18.0 ms wall against 9.5 ms of kernels
    for a 323-token prompt, and 28 ms against 11-16 for 64 sequences with a prompt among them
    (H200, docs/benchmark-log.md).

    `run` pads the step's n tokens to Q with one more sequence after the real ones: Q - n tokens
    at positions 0.. on page 0 (a block-table row of zeros), writing no K/V (slot -1), its rows
    never read. The real sequences attend exactly as eagerly: a tile of the attention kernel
    never spans two sequences. The MoE routes the padded tokens nowhere (`valid_tokens` = n), so
    they add no expert work. Capture-safety: the metadata's lists hold bounds (`metadata`), the
    attention grid covers any split of Q tokens into `max_seqs` sequences, and sequences past the
    real ones have no tokens (cu_seqlens_q repeats Q). The graph returns the logits of
    min(Q, max_seqs) rows (`rows`): those the step samples from, then whatever the buffer held.
    The step's leading decode rows, whose count only the device knows, are marked for the
    attention backend (`DecodePrefix`, written by `fill`): the Triton backend gives them the
    decode kernel, as it does eagerly, instead of a prefill tile each.
    """

    def __init__(
        self,
        model: GptOssModel,
        kv_caches: list,
        max_pages: int,
        max_context: int,
        buckets: tuple[int, ...] = PREFILL_BUCKETS,
        max_seqs: int = PREFILL_GRAPH_SEQS,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.max_context = max_context
        self.buckets = tuple(sorted(buckets))
        self.max_seqs = max_seqs
        page_size = kv_caches[0][0].shape[1]
        self.width = max_pages + -(-self.buckets[-1] // page_size)  # the padding's keys fit in its row
        # The padding's positions, for RoPE only (its rows are dropped): within the model's table.
        self.offsets = torch.arange(self.buckets[-1], dtype=torch.long, device=model.device).clamp(
            max=model.max_positions - 1
        )
        # One logits buffer for every graph (a replay writes its rows at the end of the step): the
        # graphs' outputs cost 257 rows of the vocabulary in all (207 MB at 20b), not 257 a bucket.
        self.logits = torch.empty(
            self.rows(self.buckets[-1]), model.config.vocab_size, dtype=torch.float32, device=model.device
        )
        # Block tables shared the same way (`fill` writes what a step reads): they would take 4 MB
        # a bucket and cache kind at 128k tokens of context.
        self.block_tables = {
            k: torch.zeros(max_seqs, self.width, dtype=torch.int32, device=model.device) for k in KINDS
        }
        self.graphs: dict[int, _Captured] = {}
        self.pool = None

    def rows(self, q: int) -> int:
        """Logits rows the graph of q tokens returns."""
        return min(q, self.max_seqs)

    def buffers(self, q: int) -> _Captured:
        """A bucket's buffers, holding a valid step: one sequence of q tokens that writes nothing
        (on page 0: fill the shared block tables before replaying a graph, as `run` does)."""
        dev, s = self.model.device, self.max_seqs
        return _Captured(
            input_ids=torch.zeros(q, dtype=torch.long, device=dev),
            positions=self.offsets[:q].clone(),
            slots={k: torch.full((q,), -1, dtype=torch.long, device=dev) for k in KINDS},
            context_lens=torch.full((s,), q, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0] + [q] * s, dtype=torch.int32, device=dev),
            block_tables=self.block_tables,
            row=torch.zeros(self.rows(q), dtype=torch.long, device=dev),
            valid_tokens=torch.full((1,), q, dtype=torch.int32, device=dev),
            decode_prefix=DecodePrefix(
                rows=min(q, s - 1),
                context_lens=torch.zeros(min(q, s - 1), dtype=torch.int32, device=dev),
                cu_seqlens_q=torch.tensor([0] + [q] * s, dtype=torch.int32, device=dev),
            ),
        )

    def metadata(self, buf: _Captured, exact: tuple[list[int], list[int]] | None = None) -> AttentionMetadata:
        """The step's metadata over the buffers. Its lists are bounds (the Triton kernels read the
        lengths from the device): q_lens [Q, 1, 1, ...] sizes the attention grid for any
        `max_seqs` sequences (`attention_triton._prefill`). The reference backend needs the exact
        (q_lens, context lens) of all `max_seqs` sequences instead: `exact`."""
        q, s = buf.input_ids.shape[0], self.max_seqs
        q_lens, contexts = exact or ([q] + [1] * (s - 1), [self.max_context] * s)
        return AttentionMetadata(
            cu_seqlens_q=buf.cu_seqlens_q,
            context_lens=buf.context_lens,
            block_tables=buf.block_tables,
            slot_mapping=buf.slots,
            positions=buf.positions,
            max_q_len=q,
            q_lens=q_lens,
            context_lens_list=contexts,
            decode_prefix=buf.decode_prefix,
        )

    def step(self, buf: _Captured, exact: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """The model on the buffers: the logits [rows(Q), V] of rows `buf.row` (what a replay computes)."""
        hidden = self.model(buf.input_ids, self.metadata(buf, exact), self.kv_caches, valid_tokens=buf.valid_tokens)
        return self.model.compute_logits(hidden.index_select(0, buf.row), out=self.logits[: buf.row.shape[0]])

    def capture(self) -> None:
        for q in sorted(self.buckets, reverse=True):  # largest first: the others reuse its pool
            buf = self.buffers(q)  # slots all -1: the warm-up steps write no K/V
            buf.graph, buf.logits = record_graph(lambda: self.step(buf), self.pool)
            self.pool = buf.graph.pool()
            self.graphs[q] = buf
        log.info("captured step CUDA graphs", extra={"tokens": list(self.buckets), "sequences": self.max_seqs - 1})

    def can_run(self, num_tokens: int, num_seqs: int = 1, num_rows: int = 1) -> bool:
        """Whether a step of num_tokens new tokens in num_seqs sequences, sampling from num_rows
        rows, fits a graph (one sequence slot stays for the padding)."""
        if not self.graphs or num_tokens > self.buckets[-1] or num_seqs >= self.max_seqs:
            return False
        return num_rows <= self.rows(self.bucket(num_tokens))

    def bucket(self, num_tokens: int) -> int:
        return next(q for q in self.buckets if q >= num_tokens)

    def fill(self, buf: _Captured, input_ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor) -> None:
        """Write a step (n <= Q tokens of S < max_seqs sequences; `rows` [k] int64, the rows to
        sample from) into `buf`: the padding sequence after the real ones, then sequences with
        no tokens. A dozen small copies, no host synchronisation."""
        n, q, s = input_ids.shape[0], buf.input_ids.shape[0], len(meta.q_lens)
        buf.input_ids[:n].copy_(input_ids)
        buf.input_ids[n:].zero_()
        buf.positions[:n].copy_(meta.positions)
        buf.positions[n:].copy_(self.offsets[: q - n])
        for kind, slots in buf.slots.items():
            if kind in meta.slot_mapping:  # a model without sliding layers has no sliding pool
                slots[:n].copy_(meta.slot_mapping[kind])
                slots[n:].fill_(-1)
        buf.cu_seqlens_q[: s + 1].copy_(meta.cu_seqlens_q)
        buf.cu_seqlens_q[s + 1 :].fill_(q)
        buf.context_lens[:s].copy_(meta.context_lens)
        buf.context_lens[s:].fill_(q - n)
        for kind, table in buf.block_tables.items():
            if kind in meta.block_tables:
                real = meta.block_tables[kind]
                cols = min(real.shape[1], table.shape[1])  # an eager table's padding may be wider (all -1)
                table[:s, :cols].copy_(real[:, :cols])
                table[s].zero_()
        buf.valid_tokens.fill_(n)
        buf.row[: rows.shape[0]].copy_(rows)
        # The leading decode rows (one token each: their offsets are 0..d), for the decode kernel;
        # the rest of the step without them, for the prefill kernel.
        prefix, d = buf.decode_prefix, leading_decode_rows(meta)
        prefix.context_lens[:d].copy_(meta.context_lens[:d])
        prefix.context_lens[d:].zero_()
        torch.clamp(meta.cu_seqlens_q, min=d, out=prefix.cu_seqlens_q[: s + 1])
        prefix.cu_seqlens_q[s + 1 :].fill_(q)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """A step that `can_run`; the logits [k, V] of its `rows` [k] (a view of the graphs'
        shared output buffer: read it before the next `run`)."""
        buf = self.graphs[self.bucket(input_ids.shape[0])]
        self.fill(buf, input_ids, meta, rows)
        buf.graph.replay()
        return self.logits[: rows.shape[0]]
