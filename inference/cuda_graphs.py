"""CUDA graphs for decode steps: capture the whole model once per batch size, replay per token.

At batch 1 a gpt-oss step is ~100 kernel launches of a few microseconds each; launching them
from Python costs more than running them. A captured graph replays them with one launch.

Each captured size owns static input buffers (token ids, positions, slot mappings, context
lengths, block tables). `run` copies the step's real values into the smallest captured size that
fits, pads the rest with harmless rows (slot -1: no KV write; context 1 on page 0), replays, and
returns the real rows' logits. Batches larger than every captured size run eagerly.

The attention and MoE backends must be capture-safe in decode: no host synchronisation and no
dependence on the metadata's Python lists beyond their length (the lists passed at capture
hold upper bounds: every context is `max_context`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .model import GptOssModel

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slots: dict[str, torch.Tensor]  # [B] int64 per cache kind
    context_lens: torch.Tensor  # [B] int32
    block_tables: dict[str, torch.Tensor]  # [B, P] int32 per cache kind
    logits: torch.Tensor  # [B, V] float32, written by the graph


class DecodeGraphRunner:
    """Captured decode steps for one model and one set of KV caches.

    kv_caches: the per-layer (k_cache, v_cache) the engine allocated; max_pages: block-table width;
    max_context: the longest context any sequence may reach (bounds split-K work in attention).
    """

    def __init__(
        self,
        model: GptOssModel,
        kv_caches: list,
        max_pages: int,
        max_context: int,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        max_batch: int | None = None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.max_pages = max_pages
        self.max_context = max_context
        limit = max_batch or max(batch_sizes)
        self.batch_sizes = tuple(sorted(b for b in batch_sizes if b <= limit))
        self.graphs: dict[int, _Captured] = {}
        self.pool = None

    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs reuse its memory pool."""
        for b in sorted(self.batch_sizes, reverse=True):
            self.graphs[b] = self._capture_one(b)
        log.info("captured decode CUDA graphs", extra={"batch_sizes": list(self.batch_sizes)})

    def _capture_one(self, b: int) -> _Captured:
        dev = self.model.device
        buf = _Captured(
            graph=torch.cuda.CUDAGraph(),
            input_ids=torch.zeros(b, dtype=torch.long, device=dev),
            positions=torch.zeros(b, dtype=torch.long, device=dev),
            slots={k: torch.full((b,), -1, dtype=torch.long, device=dev) for k in ("full", "sliding")},
            context_lens=torch.ones(b, dtype=torch.int32, device=dev),
            block_tables={k: torch.zeros(b, self.max_pages, dtype=torch.int32, device=dev) for k in ("full", "sliding")},
            logits=torch.empty(0),
        )
        meta = self._metadata(buf, b)
        # Warm up outside the graph (Triton compiles and autotunes here), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(buf, meta)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(buf.graph, pool=self.pool):
            buf.logits = self._step(buf, meta)
        self.pool = buf.graph.pool()
        return buf

    def _metadata(self, buf: _Captured, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=buf.input_ids.device),
            context_lens=buf.context_lens,
            block_tables=buf.block_tables,
            slot_mapping=buf.slots,
            positions=buf.positions,
            max_q_len=1,
            q_lens=[1] * b,
            context_lens_list=[self.max_context] * b,
        )

    def _step(self, buf: _Captured, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(buf.input_ids, meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    def can_run(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode step for `len(input_ids)` sequences (meta must be decode-only). Returns logits [B, V].

        The returned tensor is the graph's output buffer: read it before the next `run`.
        """
        n = input_ids.shape[0]
        size = next(b for b in self.batch_sizes if b >= n)
        buf = self.graphs[size]
        buf.input_ids[:n].copy_(input_ids, non_blocking=True)
        buf.positions[:n].copy_(meta.positions, non_blocking=True)
        buf.context_lens[:n].copy_(meta.context_lens, non_blocking=True)
        buf.context_lens[n:].fill_(1)
        for kind in ("full", "sliding"):
            buf.slots[kind][:n].copy_(meta.slot_mapping[kind], non_blocking=True)
            buf.slots[kind][n:].fill_(-1)
            table = meta.block_tables[kind]
            buf.block_tables[kind][:n, : table.shape[1]].copy_(table, non_blocking=True)
            buf.block_tables[kind][:n, table.shape[1] :].fill_(-1)
            buf.block_tables[kind][n:].fill_(0)
        buf.graph.replay()
        return buf.logits[:n]
