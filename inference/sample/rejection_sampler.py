"""Verifying draft tokens: how many of a sequence's k drafts the target model keeps, and the
token that follows them, such that the output has exactly the target's distribution.

One verification step ran the target on [last token, d_1 .. d_k] and produced k + 1 rows of
logits: row i is the target's distribution p_i for the token after d_1 .. d_i (row 0: after the
last token). With a draft distribution q_i (one-hot for deterministic drafters, which is what
the n-gram and EAGLE-3 drafters are):

    greedy (temperature 0):  keep d_i while d_i == argmax p_i; at the first mismatch emit
                             argmax p_i instead; if all k are kept, emit argmax p_k as a bonus.
    sampling:                keep d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
                             rejection emit a sample of the residual norm(max(p_i - q_i, 0))
                             and stop; if all k are kept, emit a sample of p_k.

This is the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): each
emitted token is distributed exactly as the target's, whatever the drafts were. Here p_i is the
distribution the plain sampler would draw from at that point (logit bias, penalties counting
the drafts before it as generated, the grammar after the drafts before it, temperature, top_k /
top_p / min_p), so speculation never changes what a request can produce. Samples use the
exponential race, like `Sampler`; a seeded request draws from its own generator, so it stays
reproducible (for a given drafter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.request import SamplingParams, TokenLogprob
from inference.sample.argmax_triton import argmax_rows
from inference.sample.sampler import Sampler
from inference.sample.token_mask import TokenMasks, apply_token_masks


@dataclass
class VerifyOutput:
    """Per sequence: the emitted tokens (kept drafts, then one from the target) and their logprobs."""

    token_ids: list[list[int]]
    num_accepted: list[int]  # how many drafts were kept
    logprobs: list[list[TokenLogprob] | None]


class RejectionSampler(Sampler):
    @torch.inference_mode()
    def verify(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        params: list[SamplingParams],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        draft_probs: list[torch.Tensor | None] | None = None,
        masks: TokenMasks | None = None,
    ) -> VerifyOutput:
        """logits: [R, V] float32, R = sum(len(d) + 1 for d in drafts): sequence b's rows are
        consecutive, one per draft and one more after them. draft_probs[b]: [len(drafts[b]), V]
        distributions the drafts were sampled from, or None for deterministic drafts (one-hot).
        output_ids[b]: tokens b has generated before this step (for penalties). masks: grammar
        masks of the rows that have one (a constrained sequence's drafts are ones its grammar
        allows, and each of its rows holds what the grammar allows after the drafts before it)."""
        device = logits.device
        counts = [len(d) + 1 for d in drafts]
        row_params = [p for p, c in zip(params, counts) for _ in range(c)]
        penalised = [p.frequency_penalty or p.presence_penalty for p in params]
        # Row i of a sequence sees drafts d_1 .. d_i as already generated.
        row_history = [
            out + d[:i] if pen else [] for out, d, pen in zip(output_ids, drafts, penalised) for i in range(len(d) + 1)
        ]
        processed = self._apply_bias_and_penalties(logits, row_params, row_history)
        processed = apply_token_masks(processed, masks, inplace=processed is not logits)
        best = argmax_rows(processed)  # [R]
        first = [0]
        for c in counts:
            first.append(first[-1] + c)
        draft_tokens = torch.tensor([t for d in drafts for t in d + [0]], dtype=torch.long, device=device)

        accept = torch.zeros(len(row_params), dtype=torch.bool, device=device)
        sampled = torch.zeros_like(best)
        sampled_seqs = [b for b, p in enumerate(params) if not p.greedy]
        if sampled_seqs:
            row_list = [r for b in sampled_seqs for r in range(first[b], first[b + 1])]
            rows = torch.tensor(row_list, device=device)
            temperature = torch.tensor([row_params[r].temperature for r in row_list], device=device)
            probs = self._truncated_probs(processed[rows] / temperature[:, None], [row_params[r] for r in row_list])
            # q: the draft distribution per row; the row after the last draft has none (zeros).
            q = torch.zeros_like(probs)
            offset = 0
            for b in sampled_seqs:
                k = len(drafts[b])
                given = draft_probs[b] if draft_probs is not None else None
                if given is not None:
                    q[offset : offset + k] = given.to(device=device, dtype=q.dtype)
                elif k:
                    q[torch.arange(offset, offset + k, device=device), draft_tokens[rows[offset : offset + k]]] = 1.0
                offset += k + 1
            d = draft_tokens[rows][:, None]
            p_d = probs.gather(1, d).squeeze(1)
            q_d = q.gather(1, d).squeeze(1)
            residual = (probs - q).clamp_min_(0.0)
            # p == q leaves no residual, but then p(d)/q(d) = 1 and the draft is always kept.
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            residual = torch.where(empty, probs, residual)
            uniform, noise = self._draws(sampled_seqs, counts, generators, probs.shape[-1], device)
            accept[rows] = uniform * q_d < p_d
            sampled[rows] = (residual / noise.clamp_min_(1e-20)).argmax(dim=-1)

        best_l, accept_l, sampled_l = best.tolist(), accept.tolist(), sampled.tolist()
        tokens: list[list[int]] = []
        num_accepted: list[int] = []
        for b, (d, p) in enumerate(zip(drafts, params)):
            out: list[int] = []
            for i, token in enumerate(d):
                r = first[b] + i
                keep = token == best_l[r] if p.greedy else accept_l[r]
                if not keep:
                    break
                out.append(token)
            kept = len(out)
            r = first[b] + kept
            out.append(best_l[r] if p.greedy else sampled_l[r])
            tokens.append(out)
            num_accepted.append(kept)
        return VerifyOutput(tokens, num_accepted, self._emitted_logprobs(logits, tokens, params, first))

    @staticmethod
    def _draws(seqs, counts, generators, vocab, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniforms [rows] and Exp(1) noise [rows, V] for the rows of `seqs`, in row order; a
        seeded sequence draws its own from its generator (uniforms first, then noise)."""
        total = sum(counts[b] for b in seqs)
        uniform = torch.empty(total, device=device)
        noise = torch.empty(total, vocab, device=device)
        offset = 0
        for b in seqs:
            c, g = counts[b], generators[b]
            uniform[offset : offset + c].uniform_(generator=g)
            noise[offset : offset + c].exponential_(generator=g)
            offset += c
        return uniform, noise

    def _emitted_logprobs(self, logits, tokens, params, first) -> list[list[TokenLogprob] | None]:
        wanted = [b for b, p in enumerate(params) if p.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(params)
        if not wanted:
            return out
        rows = [first[b] + i for b in wanted for i in range(len(tokens[b]))]
        chosen = torch.tensor([t for b in wanted for t in tokens[b]], device=logits.device)
        row_params = [params[b] for b in wanted for _ in tokens[b]]
        flat = self._logprobs(logits[torch.tensor(rows, device=logits.device)], chosen, row_params)
        offset = 0
        for b in wanted:
            out[b] = flat[offset : offset + len(tokens[b])]
            offset += len(tokens[b])
        return out
