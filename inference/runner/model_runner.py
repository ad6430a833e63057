"""One engine step on the device: scheduled batch -> AttentionMetadata -> model -> logits -> sampler.

The batch is flattened into one ragged row of new tokens (see `inference/ops/attention/reference.py`). Logits
are computed only for the last new token of sequences that reach their end in this step (a
prefill chunk that stops short of the prompt's end samples nothing), and, with speculative
decoding, for each draft token a sequence verifies (`inference/sample/rejection_sampler.py` decides
which drafts stay). On CUDA, decode-only steps and verification steps with the same number of
drafts per sequence replay captured CUDA graphs (`inference/runner/cuda_graphs.py`) unless `enforce_eager`;
other steps of up to 256 sequences and 1024 tokens, or a capped prefill chunk beside the decode
rows (prefill chunks, requests joining a running batch), replay the step graph of their token
bucket; larger ones run eagerly.

A step is first described in plain Python values (`StepPlan`), then run (`execute`): its integer
inputs go to the device packed in one buffer with one copy (`inference/runner/step_inputs.py`). Under
tensor parallelism rank 0 sends that plan to the other ranks (`workers`), which run the same
`execute` on their shards; only rank 0 samples. A step whose every sampled row is plain greedy
(`StepPlan.greedy`) takes its tokens from a vocabulary-parallel argmax, with no gather of the
logits (`inference/runner/vocab_parallel.py`).

`run` = `launch` (queue the model and the sampling on the device) then `collect` (read the
tokens back). Between the two the engine may launch the next decode step, whose input tokens are
this step's sampled ids taken on the device (`launch(..., after=)`; async scheduling,
`inference/scheduling/async_scheduling.py`).

Rows of constrained requests are sampled under their grammar's mask (`inference/sample/token_mask.py`),
which depends on every token before: a step launched ahead queues its model work at once but its
sampling only once the engine has read the previous step's tokens and advanced the grammars
(`sample_pending`), when a row of it has a grammar.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference.model.gpt_oss import GptOssModel
from inference.ops.attention.reference import AttentionMetadata
from inference.request import TokenLogprob
from inference.runner.step_inputs import StepInputPacker, StepInputs, table_width
from inference.runner.vocab_parallel import vocab_parallel_argmax
from inference.sample.rejection_sampler import RejectionSampler, VerifyOutput
from inference.sample.sampler import SampledTokens
from inference.sample.token_mask import MaskedEntry, TokenMaskBuilder, TokenMasks
from inference.scheduling.scheduler import ScheduledBatch, Sequence, SequenceStatus
from inference.transfers import to_device

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step as plain values (cheap to send to tensor-parallel workers). T new tokens in all;
    sequence b runs q_lens[b] of them from position starts[b]."""

    input_ids: list[int]  # [T]
    full_tables: list[list[int]]  # each sequence's full-pool pages
    sliding_tables: list[list[int]] | None  # sliding-pool pages; None: the model has no sliding layers
    starts: list[int]
    q_lens: list[int]
    sample_rows: list[int]  # rows that need logits (each sampling entry's last 1 + drafts)
    graph_tokens: int | None = None  # replay the captured graph of this many tokens per sequence; None: eager
    # The first previous_rows input_ids are rows of the previous step's sampled ids (still on
    # the device), not token ids.
    previous_rows: int = 0
    # Tensor parallel: every sampled row is plain greedy (`plain_greedy`), so the ranks agree on
    # the argmax and no rank gathers the logits.
    greedy: bool = False


def plain_greedy(params) -> bool:
    """Whether a row's next token is the plain argmax of its logits: greedy, with no logprobs,
    logit bias, penalty or grammar (which need the whole row of logits on rank 0)."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and not params.frequency_penalty
        and not params.presence_penalty
        and params.grammar is None
    )


@dataclass
class StepOutput:
    """Per batch entry: the tokens to append (empty when the entry only prefilled; with drafts,
    the kept drafts then one more), their logprobs, and how many drafts were kept."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]
    num_accepted: list[int]
    first_row: list[int]  # each entry's first row in the flat batch (indexes aux_hidden)
    aux_hidden: torch.Tensor | None = None  # [T, A] target layer outputs the drafter asked for


@dataclass
class LaunchedStep:
    """A step whose model and sampling work is queued on the device; `ModelRunner.collect` reads
    its tokens back."""

    batch: ScheduledBatch
    first_row: list[int]
    aux_hidden: torch.Tensor | None
    plain: list[int]  # batch entries sampled without drafts, in the order of `sampled`'s rows
    sampled: SampledTokens | None
    verified: list[int]  # batch entries whose drafts were verified (already on the host)
    verify_out: VerifyOutput | None
    # Launched ahead with a constrained row: (the plain rows' logits, their sequences), sampled
    # by `ModelRunner.sample_pending` once the previous step's tokens are applied.
    pending: tuple[torch.Tensor, list[Sequence]] | None = None

    def token_rows(self) -> dict[Sequence, int]:
        """Each plainly sampled sequence's row in `sampled.tokens` (which holds its next token)."""
        return {self.batch.seqs[b]: j for j, b in enumerate(self.plain)}


def build_metadata(
    page_size: int,
    full_tables: list[list[int]],
    sliding_tables: list[list[int]] | None,
    starts: list[int],
    q_lens: list[int],
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens sit at positions [starts[b], starts[b] + q_lens[b]).

    full_tables / sliding_tables: each sequence's physical pages per logical page (-1 = none);
    sliding_tables None means the model has no sliding layers (the full table stands in).
    """
    ps = page_size
    width = table_width(max(len(t) for t in full_tables), q_lens)
    full = torch.tensor([t + [-1] * (width - len(t)) for t in full_tables], dtype=torch.int32)
    if sliding_tables is not None:
        sliding = torch.tensor([t + [-1] * (width - len(t)) for t in sliding_tables], dtype=torch.int32)
    else:  # no sliding layers: the table is never read
        sliding = full
    # Flat token t belongs to sequence seq_index[t] and sits at starts[seq] + its offset.
    q = torch.tensor(q_lens)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(q, 0, out=cu[1:])
    seq_index = torch.repeat_interleave(torch.arange(len(q_lens)), q)
    offset = torch.arange(int(cu[-1])) - cu[:-1].long()[seq_index]
    positions = torch.tensor(starts)[seq_index] + offset
    page, within = positions // ps, positions % ps
    slots = {
        "full": full[seq_index, page].long() * ps + within,
        "sliding": sliding[seq_index, page].long() * ps + within,
    }
    context = [s + n for s, n in zip(starts, q_lens)]
    return AttentionMetadata(
        cu_seqlens_q=cu.to(device),
        context_lens=torch.tensor(context, dtype=torch.int32).to(device),
        block_tables={"full": full.to(device), "sliding": sliding.to(device)},
        slot_mapping={k: v.to(device) for k, v in slots.items()},
        positions=positions.to(device),
        max_q_len=max(q_lens),
        q_lens=list(q_lens),
        context_lens_list=context,
    )


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
        aux_layers: tuple[int, ...] = (),
        num_draft_tokens: int = 0,
        max_prefill_tokens_decoding: int | None = None,
    ):
        """aux_layers: target layers whose outputs a drafter reads (returned with each step);
        num_draft_tokens: with speculation, verification steps of that many drafts get graphs too;
        max_prefill_tokens_decoding: the scheduler's prefill cap while sequences decode, which
        bounds the mixed steps the step graphs are captured for (`step_graph_buckets`)."""
        self.model = model
        self.has_sliding = has_sliding
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = model.device
        self.sampler = RejectionSampler()
        self.masks = TokenMaskBuilder(self.device)
        self.aux_layers = tuple(aux_layers)
        self.packer = StepInputPacker(page_size, self.device)
        self.workers = None  # tensor parallel, on rank 0: `inference.engine.executor.WorkerProcesses`, sent every step
        self.graphs = None
        self.prefill_graphs = None
        self._graph_args = (max_model_len, max_num_seqs, num_draft_tokens)
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = self._capture_graphs(max_model_len, max_num_seqs, num_draft_tokens)
            if model.tp is None and not self.aux_layers:
                self.prefill_graphs = self._capture_prefill_graphs(
                    max_model_len, max_num_seqs, max_prefill_tokens_decoding
                )
        self.sampler.warm_up(model.config.vocab_size, self.device)

    def _capture_graphs(self, max_model_len: int, max_num_seqs: int, num_draft_tokens: int):
        from inference.runner.cuda_graphs import DecodeGraphRunner

        max_pages = -(-max_model_len // self.page_size)
        tokens_per_seq = (1, num_draft_tokens + 1) if num_draft_tokens else (1,)
        try:
            runner = DecodeGraphRunner(
                self.model,
                self.kv_caches,
                max_pages,
                max_model_len,
                max_batch=max_num_seqs,
                tokens_per_seq=tokens_per_seq,
                aux_layers=self.aux_layers,
            )
            runner.capture()
            return runner
        except Exception:  # a backend that cannot be captured still serves, eagerly
            if self.model.tp is not None:  # ...but not alone: the other ranks' collectives would wait
                raise
            log.exception("CUDA graph capture failed; decode runs eagerly")
            return None

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again (after the model's collectives changed: every
        tensor-parallel rank does it at once, as at start-up)."""
        if self.graphs is None:
            return
        self.graphs.release()
        torch.cuda.synchronize()
        self.graphs = self._capture_graphs(*self._graph_args)

    def _capture_prefill_graphs(self, max_model_len: int, max_num_seqs: int, max_prefill_tokens_decoding: int | None):
        from inference.runner.cuda_graphs import PrefillGraphRunner, step_graph_buckets

        try:
            runner = PrefillGraphRunner(
                self.model,
                self.kv_caches,
                -(-max_model_len // self.page_size),
                max_model_len,
                buckets=step_graph_buckets(max_num_seqs, max_prefill_tokens_decoding),
            )
            runner.capture()
            return runner
        except Exception:  # short prefills then run eagerly, as longer ones do
            log.exception("prefill CUDA graph capture failed; prefill runs eagerly")
            return None

    def plan(self, batch: ScheduledBatch) -> tuple[StepPlan, list[int], list[int]]:
        """(the step's plan, which batch entries sample a token, each entry's first row)."""
        seqs, q_lens = batch.seqs, batch.num_new
        drafts = batch.num_draft or [0] * len(seqs)
        starts = [seq.num_computed for seq in seqs]
        ids: list[int] = []
        first_row: list[int] = []
        sample_index: list[int] = []
        sample_rows: list[int] = []
        for b, (seq, s, n, d) in enumerate(zip(seqs, starts, q_lens, drafts)):
            first_row.append(len(ids))
            ids.extend(seq.token_ids[s : s + n - d])
            ids.extend(seq.draft_ids[:d])
            if s + n - d == seq.num_tokens:  # reaches the end: sample (and verify the drafts)
                sample_index.append(b)
                sample_rows.extend(range(len(ids) - d - 1, len(ids)))
        # Graphs cover steps where every sequence runs the same number of tokens: plain decode
        # (1 each) or verification of the same number of drafts each.
        q_len = q_lens[0]
        uniform = all(n == q_len for n in q_lens) and (q_len == 1 or all(d == q_len - 1 for d in drafts))
        graph = self.graphs is not None and uniform and self.graphs.can_run(len(batch), q_len)
        greedy = (
            self.model.tp is not None
            and bool(sample_index)
            and not any(drafts)
            and all(plain_greedy(seqs[b].sampling) for b in sample_index)
        )
        plan = StepPlan(
            ids,
            [seq.pages.full for seq in seqs],
            [seq.pages.sliding for seq in seqs] if self.has_sliding else None,
            starts,
            list(q_lens),
            sample_rows,
            q_len if graph else None,
            greedy=greedy,
        )
        return plan, sample_index, first_row

    def plan_after(self, batch: ScheduledBatch, after: LaunchedStep) -> tuple[StepPlan, list[int], list[int]]:
        """`plan` for a step launched before `after`'s tokens are known (`Scheduler.schedule_after`):
        each sequence starts where `after` leaves it (its pages reserved). The leading entries
        that `after` samples decode one token each, their input the token `after` sampled,
        gathered on the device; the others (prompt chunks, requests joining) take token ids."""
        seqs = batch.seqs
        rows = after.token_rows()
        computed = {seq: seq.num_computed + k for seq, k in zip(after.batch.seqs, after.batch.num_new)}
        starts = [computed.get(seq, seq.num_computed) for seq in seqs]
        ids: list[int] = []
        sample_index: list[int] = []
        first_row: list[int] = []
        previous_rows = 0
        for b, (seq, start, n) in enumerate(zip(seqs, starts, batch.num_new)):
            first_row.append(len(ids))
            if seq in rows:  # decodes the token `after` samples for it
                if b != previous_rows:
                    raise ValueError("the rows taking the previous step's samples must lead the batch")
                previous_rows += 1
                ids.append(rows[seq])
                sample_index.append(b)
            else:
                ids.extend(seq.token_ids[start : start + n])
                if start + n == seq.num_tokens:
                    sample_index.append(b)
        decode = previous_rows == len(seqs)
        graph = decode and self.graphs is not None and self.graphs.can_run(len(seqs), 1)
        plan = StepPlan(
            ids,
            [seq.pages.full for seq in seqs],
            [seq.pages.sliding for seq in seqs] if self.has_sliding else None,
            starts,
            list(batch.num_new),
            [first_row[b] + batch.num_new[b] - 1 for b in sample_index],
            1 if graph else None,
            previous_rows=previous_rows,
        )
        return plan, sample_index, first_row

    def prepare(self, plan: StepPlan) -> StepInputs:
        return self.packer.pack(
            plan.input_ids, plan.full_tables, plan.sliding_tables, plan.starts, plan.q_lens, plan.sample_rows
        )

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, previous_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Run the model on this device (every tensor-parallel rank runs each plan).
        previous_tokens: the previous step's sampled ids [N] when plan.previous_rows.
        Returns (logits of plan.sample_rows [S, V] float32 or None if none, aux hidden or None,
        greedy tokens [S] int64 or None): a tensor-parallel `plan.greedy` step returns the
        tokens instead of the logits. After a graph step they may be views of the graph's
        output buffers: valid until the next `execute`, so consume (or queue work on) them first."""
        inputs = self.prepare(plan)
        previous = previous_tokens if plan.previous_rows else None
        tp = self.model.tp
        if plan.graph_tokens is not None:  # the graph's input kernel gathers the previous ids itself
            logits, aux, ids = self.graphs.run(inputs.input_ids, inputs.meta, plan.graph_tokens, previous=previous)
            if plan.sample_rows != list(range(len(plan.input_ids))):  # not plain decode (every row, in order)
                logits = logits[inputs.sample_rows]
                ids = ids[inputs.sample_rows] if ids is not None else None
            if tp is None:
                return logits, aux, None
            if plan.greedy:
                return None, aux, ids
            return self.model.gather_logits(logits), aux, None  # (collective: every rank gathers)
        input_ids = inputs.input_ids
        if previous is not None:  # the leading rows decode the previous step's samples
            d = plan.previous_rows
            input_ids = (
                previous[input_ids] if d == len(input_ids) else torch.cat([previous[input_ids[:d]], input_ids[d:]])
            )
        if self._step_graph_fits(plan):  # a prefill chunk, or requests joining a batch: one replay
            logits = self.prefill_graphs.run(input_ids, inputs.meta, inputs.sample_rows)
            return (logits if plan.sample_rows else None), None, None
        out = self.model(input_ids, inputs.meta, self.kv_caches, aux_layers=self.aux_layers)
        hidden, aux = out if self.aux_layers else (out, None)
        if not plan.sample_rows:
            return None, aux, None
        hidden = hidden[inputs.sample_rows]
        if tp is not None and plan.greedy:
            return None, aux, vocab_parallel_argmax(tp, self.model.logits_shard(hidden))
        return self.model.compute_logits(hidden), aux, None

    def _step_graph_fits(self, plan: StepPlan) -> bool:
        """A step no decode graph runs (prefill chunks, with or without decode rows beside them;
        uneven drafts), of at most the largest captured bucket's tokens and sequences."""
        return (
            self.prefill_graphs is not None
            and plan.graph_tokens is None
            and self.prefill_graphs.can_run(len(plan.input_ids), len(plan.q_lens), len(plan.sample_rows))
        )

    def forward_step(
        self, plan: StepPlan, previous_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`execute` on every rank: hand the plan to the tensor-parallel workers first, if any."""
        if self.workers is not None:
            if plan.previous_rows:  # the workers hold no sampled ids
                raise RuntimeError("a step taking the previous step's ids cannot run tensor-parallel")
            self.workers.send_step(plan)
        return self.execute(plan, previous_tokens)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's model and sampling work on the device. Plain sampling does not wait
        for the device; verifying drafts does. `after`: a launched step whose sampled ids are this
        step's inputs (see `plan_after`)."""
        plan, sample_index, first_row = self.plan(batch) if after is None else self.plan_after(batch, after)
        # (A launched step that samples nothing, a prompt chunk alone, leaves no previous rows.)
        logits, aux, greedy_ids = self.forward_step(plan, after.sampled.tokens if plan.previous_rows else None)
        drafts = batch.num_draft or [0] * len(batch)
        rows, plain, verified = 0, [], []  # logits holds each sampling entry's 1 + drafts rows, in order
        for b in sample_index:
            (verified if drafts[b] else plain).append((b, rows))
            rows += drafts[b] + 1
        sampled = verify_out = pending = None
        if plain and greedy_ids is not None:  # tensor-parallel greedy step: the ranks' argmax (no drafts)
            sampled = SampledTokens(greedy_ids, [batch.seqs[b].sampling for b, _ in plain], None)
        elif plain:
            seqs = [batch.seqs[b] for b, _ in plain]
            rows_logits = (
                logits if not verified else logits[to_device([r for _, r in plain], torch.long, logits.device)]
            )
            if after is not None and any(s.grammar is not None for s in seqs):
                pending = (rows_logits, seqs)  # its masks need `after`'s tokens
            else:
                sampled = self._sample(rows_logits, seqs)
        if verified:
            seqs = [batch.seqs[b] for b, _ in verified]
            row_index = [r + i for b, r in verified for i in range(drafts[b] + 1)]
            draft_ids = [s.draft_ids[: drafts[b]] for (b, _), s in zip(verified, seqs)]
            firsts = [0]
            for d in draft_ids:
                firsts.append(firsts[-1] + len(d) + 1)
            masks = self.masks.build(
                [
                    MaskedEntry(first, s.grammar, tuple(d))
                    for s, d, first in zip(seqs, draft_ids, firsts)
                    if s.grammar is not None
                ]
            )
            verify_out = self.sampler.verify(
                logits[to_device(row_index, torch.long, logits.device)],
                draft_ids,
                [s.sampling for s in seqs],
                [self._history(s) for s in seqs],
                [s.generator for s in seqs],
                masks=masks,
            )
        return LaunchedStep(
            batch, first_row, aux, [b for b, _ in plain], sampled, [b for b, _ in verified], verify_out, pending
        )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        return self.sampler.sample(
            logits,
            [s.sampling for s in seqs],
            [self._history(s) for s in seqs],
            [s.generator for s in seqs],
            self._masks(seqs),
        )

    def _masks(self, seqs: list[Sequence]) -> TokenMasks | None:
        """Grammar masks of the rows of `seqs` that have a grammar (not of sequences that ended
        while their row was queued: that row is dropped)."""
        return self.masks.build(
            [
                MaskedEntry(j, s.grammar)
                for j, s in enumerate(seqs)
                if s.grammar is not None and s.status == SequenceStatus.RUNNING
            ]
        )

    def sample_pending(self, step: LaunchedStep) -> None:
        """Queue the sampling of a step launched ahead with constrained rows, now that the
        previous step's tokens have advanced their grammars."""
        if step.pending is not None:
            logits, seqs = step.pending
            step.pending = None
            step.sampled = self._sample(logits, seqs)

    def collect(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step's tokens (only its own work, not steps launched after it)."""
        self.sample_pending(step)
        n = len(step.batch)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob] | None] = [None] * n
        accepted = [0] * n
        if step.sampled is not None:
            out = step.sampled.result()
            for b, token, logprob in zip(step.plain, out.token_ids, out.logprobs):
                tokens[b], logprobs[b] = [token], [logprob] if logprob is not None else None
        if step.verify_out is not None:
            out = step.verify_out
            for b, toks, lps, k in zip(step.verified, out.token_ids, out.logprobs, out.num_accepted):
                tokens[b], logprobs[b], accepted[b] = toks, lps, k
        return StepOutput(tokens, logprobs, accepted, step.first_row, step.aux_hidden)

    @staticmethod
    def _history(seq) -> list[int]:
        # Penalties count generated tokens; copying them is only worth it where one is set.
        p = seq.sampling
        return seq.output_ids if p.frequency_penalty or p.presence_penalty else []
