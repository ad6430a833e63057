"""One engine step on the device: scheduled batch -> AttentionMetadata -> model -> logits -> sampler.

The batch is flattened into one ragged row of new tokens (see `inference/attention.py`). Logits
are computed only for the last new token of sequences that reach their end in this step (a
prefill chunk that stops short of the prompt's end samples nothing). On CUDA, decode-only steps
replay captured CUDA graphs (`inference/cuda_graphs.py`) unless `enforce_eager`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .model import GptOssModel
from .request import TokenLogprob
from .sampler import Sampler
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_index: list[int]  # which batch entries sample a token this step
    sample_rows: torch.Tensor  # [S] int64, their last token's row in the flat batch


@dataclass
class StepOutput:
    """Per batch entry: the sampled token (None when the entry only prefilled) and its logprob."""

    token_ids: list[int | None]
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    def __init__(
        self,
        model: GptOssModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        has_sliding: bool = True,
        enforce_eager: bool = False,
    ):
        self.model = model
        self.has_sliding = has_sliding
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = model.device
        self.sampler = Sampler()
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = self._capture_graphs(max_model_len, max_num_seqs)

    def _capture_graphs(self, max_model_len: int, max_num_seqs: int):
        from .cuda_graphs import DecodeGraphRunner

        max_pages = -(-max_model_len // self.page_size)
        try:
            runner = DecodeGraphRunner(self.model, self.kv_caches, max_pages, max_model_len, max_batch=max_num_seqs)
            runner.capture()
            return runner
        except Exception:  # a backend that cannot be captured still serves, eagerly
            log.exception("CUDA graph capture failed; decode runs eagerly")
            return None

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        ps = self.page_size
        seqs, q_lens = batch.seqs, batch.num_new
        starts = [seq.num_computed for seq in seqs]
        context = [s + n for s, n in zip(starts, q_lens)]
        ids: list[int] = []
        for seq, s, n in zip(seqs, starts, q_lens):
            ids.extend(seq.token_ids[s : s + n])
        width = max(len(seq.pages.full) for seq in seqs)
        full = torch.tensor([seq.pages.full + [-1] * (width - len(seq.pages.full)) for seq in seqs], dtype=torch.int32)
        if self.has_sliding:
            sliding = torch.tensor(
                [seq.pages.sliding + [-1] * (width - len(seq.pages.sliding)) for seq in seqs], dtype=torch.int32
            )
        else:  # no sliding layers: the table is never read
            sliding = full

        # Flat token t belongs to sequence seq_index[t] and sits at starts[seq] + its offset.
        q = torch.tensor(q_lens)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(q, 0, out=cu[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q)
        offset = torch.arange(len(ids)) - cu[:-1].long()[seq_index]
        positions = torch.tensor(starts)[seq_index] + offset
        page, within = positions // ps, positions % ps
        slots = {
            "full": full[seq_index, page].long() * ps + within,
            "sliding": sliding[seq_index, page].long() * ps + within,
        }
        sample_index = [b for b, seq in enumerate(seqs) if context[b] == seq.num_tokens]
        sample_rows = cu[1:].long()[sample_index] - 1

        dev = self.device
        meta = AttentionMetadata(
            cu_seqlens_q=cu.to(dev),
            context_lens=torch.tensor(context, dtype=torch.int32).to(dev),
            block_tables={"full": full.to(dev), "sliding": sliding.to(dev)},
            slot_mapping={k: v.to(dev) for k, v in slots.items()},
            positions=positions.to(dev),
            max_q_len=max(q_lens),
            q_lens=list(q_lens),
            context_lens_list=context,
        )
        return StepInputs(torch.tensor(ids, dtype=torch.long).to(dev), meta, sample_index, sample_rows.to(dev))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        inputs = self.prepare(batch)
        if self.graphs is not None and inputs.meta.is_decode and self.graphs.can_run(len(batch)):
            logits = self.graphs.run(inputs.input_ids, inputs.meta)[inputs.sample_rows]
        else:
            hidden = self.model(inputs.input_ids, inputs.meta, self.kv_caches)
            logits = self.model.compute_logits(hidden[inputs.sample_rows]) if inputs.sample_index else None
        tokens: list[int | None] = [None] * len(batch)
        logprobs: list[TokenLogprob | None] = [None] * len(batch)
        if inputs.sample_index:
            seqs = [batch.seqs[b] for b in inputs.sample_index]
            params = [seq.sampling for seq in seqs]
            # Penalties count generated tokens; copying them is only worth it where one is set.
            history = [s.output_ids if p.frequency_penalty or p.presence_penalty else [] for s, p in zip(seqs, params)]
            out = self.sampler(logits, params, history, [seq.generator for seq in seqs])
            for b, token, logprob in zip(inputs.sample_index, out.token_ids, out.logprobs):
                tokens[b], logprobs[b] = token, logprob
        return StepOutput(tokens, logprobs)
