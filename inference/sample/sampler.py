"""Batched sampling: one call turns a step's logits into next tokens (and logprobs).

Order of operations per row, all on the logits' device:
    logits += logit_bias
    logits -= frequency_penalty * count + presence_penalty * (count > 0)   (count: generated tokens)
    logits[t] = -inf for each token t the row's grammar disallows (rows with one: `token_mask.py`)
    temperature 0  -> argmax (and any below GREEDY_TEMPERATURE)
    otherwise      -> logits / temperature, keep the top_k, keep the smallest set with mass
                      >= top_p, drop tokens below min_p * p_max, sample
Sampling uses the exponential race (argmax p_i / E_i with E_i ~ Exp(1)), which draws from p
exactly. A seeded row draws its randomness from its own `torch.Generator`, so the same seed
gives the same tokens whatever else is in the batch. Logprobs are those of the model's raw
distribution (log_softmax of the logits before any of the above), as OpenAI reports them. The
argmaxes run `inference/sample/argmax_triton.py` on CUDA (one 201k-wide row is a single slow
reduction for torch.argmax). There, a step with a sampled row races all its rows in that
module's one-pass kernel, greedy rows beside sampled ones: one read of the logits, where the
torch ops (`_race_in_torch`, the path elsewhere) read and write a dozen [N, V] tensors. Each
sampled row's Philox key comes from the default CUDA generator, or from the row's own generator
when seeded (one draw a step). A row that truncates (top_k / top_p / min_p) races above a floor,
the least scaled logit its truncation keeps (`_floors`); logits tied with the last one kept are
kept too (the lm_head's logits are bf16 values, so ties happen), where the torch ops keep
exactly top_k. top_k 1 takes the argmax.

`Sampler.sample` only queues that work on the device and starts copying the ids (and logprobs)
to the host: nothing in it waits for the stream, but for truncation that may need a whole row
(a top_p without a top_k, or a top_k past the best candidates: `_truncation_floor`; on the
torch path any top_k or top_p: `_top_k_top_p`). So with async scheduling the next step can be
queued before this one's ids are read (`SampledTokens.result`). Calling the sampler does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.request import SamplingParams, TokenLogprob
from inference.sample.argmax_triton import argmax_rows, on_triton, race_argmax_rows_triton
from inference.sample.token_mask import TokenMasks, apply_token_masks
from inference.transfers import HostCopy, to_device


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class SampledTokens:
    """One batch's sampled ids, still on the device, with their copy to the host under way."""

    def __init__(self, tokens: torch.Tensor, params: list[SamplingParams], logprob_parts: list[torch.Tensor] | None):
        self.tokens = tokens  # [N] int64 on the logits' device (the next step's inputs, with async scheduling)
        self.params = params
        self._has_logprobs = logprob_parts is not None
        self._copy = HostCopy([tokens, *(logprob_parts or [])])

    def result(self) -> SamplerOutput:
        """Wait for the ids (this batch's copies only, not work queued after them)."""
        host = self._copy.get()
        token_list = host[0].tolist()
        if not self._has_logprobs:
            return SamplerOutput(token_list, [None] * len(self.params))
        return SamplerOutput(token_list, Sampler._logprob_lists(token_list, self.params, *host[1:]))


class Sampler:
    def __init__(self, race: bool = True):
        # race: sample in `race_argmax_rows_triton`'s one pass where the logits allow it (CUDA);
        # False: the torch ops for every sampled row (what `benchmarks/bench_sampler.py` compares with).
        self.race = race

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        masks: TokenMasks | None = None,
    ) -> SamplerOutput:
        """logits: [N, V] float32, one row per sequence; output_ids: tokens each has generated;
        masks: the grammar masks of the rows that have one."""
        return self.sample(logits, params, output_ids, generators, masks).result()

    @staticmethod
    def warm_up(vocab_size: int, device: torch.device) -> None:
        """Compile the argmax and race kernels (with and without floors) for rows of `vocab_size`
        logits on `device` now (CUDA), not on the first request."""
        if torch.device(device).type != "cuda":
            return
        logits = torch.zeros(1, vocab_size, device=device)
        argmax_rows(logits)
        if on_triton(logits):
            inv_temp = torch.ones(1, device=device)
            keys = torch.zeros(1, dtype=torch.long, device=device)
            race_argmax_rows_triton(logits, inv_temp, keys)
            race_argmax_rows_triton(logits, inv_temp, keys, torch.full((1,), float("-inf"), device=device))

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        masks: TokenMasks | None = None,
    ) -> SampledTokens:
        """As calling the sampler, but the ids stay on the device until `result()` is asked for."""
        device = logits.device
        processed = self._apply_bias_and_penalties(logits, params, output_ids)
        processed = apply_token_masks(processed, masks, inplace=processed is not logits)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows and self.race and on_triton(processed):
            tokens = self._race(processed, params, sampled_rows, generators)
        else:
            tokens = argmax_rows(processed)
            if sampled_rows:
                rows = to_device(sampled_rows, torch.long, device)
                tokens[rows] = self._race_in_torch(processed, params, sampled_rows, generators)
        return SampledTokens(tokens, params, self._logprob_tensors(logits, tokens, params))

    @classmethod
    def _race_in_torch(cls, logits, params, rows, generators) -> torch.Tensor:
        """Tokens [len(rows)] drawn for the rows `rows` of logits [N, V] with torch ops: scale,
        truncate (`_truncated_probs`), then argmax p / E with E ~ Exp(1) drawn on the device (a
        seeded row's from its own generator)."""
        device = logits.device
        index = to_device(rows, torch.long, device)
        temperature = to_device([params[i].temperature for i in rows], torch.float32, device)
        probs = cls._truncated_probs(logits[index] / temperature[:, None], [params[i] for i in rows])
        noise = torch.empty_like(probs)
        seeded = [(j, generators[i]) for j, i in enumerate(rows) if generators[i] is not None]
        if len(seeded) < len(rows):
            noise.exponential_()
        for j, generator in seeded:
            noise[j].exponential_(generator=generator)
        return argmax_rows(probs / noise.clamp_min_(1e-20))

    @classmethod
    def _race(cls, logits, params, rows, generators) -> torch.Tensor:
        """Tokens [N] of every row of logits [N, V] in one pass: the rows in `rows` drawn at
        their temperature (`race_argmax_rows_triton`), the others their argmax. A row that
        truncates races above its floor (`_floors`)."""
        device = logits.device
        inv_list = [0.0] * len(params)
        for i in rows:
            # top_k 1 keeps one token: the argmax (its first index among tied logits, which a
            # floor would keep whole).
            inv_list[i] = 0.0 if params[i].top_k == 1 else 1.0 / params[i].temperature
        inv_temp = to_device(inv_list, torch.float32, device)
        keys = torch.randint(0, RACE_KEY_END, (len(params),), device=device)
        for i in rows:
            if generators[i] is not None:
                keys[i : i + 1].random_(0, RACE_KEY_END, generator=generators[i])
        truncating = [i for i in rows if params[i].truncates and params[i].top_k != 1]
        floors = cls._floors(logits, inv_temp, params, truncating) if truncating else None
        return race_argmax_rows_triton(logits, inv_temp, keys, floors)

    @classmethod
    def _floors(cls, logits, inv_temp, params, rows) -> torch.Tensor:
        """[N] float32: for each row in `rows`, the least logit * inv_temp its top_k, top_p and
        min_p keep (the kept set is every logit at or above it: the same set as the masks of
        `_truncated_probs`, but for ties at the cut, which it keeps whole); -inf elsewhere.
        Computed on the scaled logits as the race kernel scales them (a multiply by the same
        float32 inv_temp), so the last kept logit compares equal there."""
        device = logits.device
        index = to_device(rows, torch.long, device)
        scaled = logits[index] * inv_temp[index, None]
        chosen = [params[i] for i in rows]
        floor = torch.full((len(rows),), float("-inf"), device=device)
        vocab = scaled.shape[-1]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in chosen]  # vocab: off
        if any(k < vocab or p.top_p < 1 for k, p in zip(ks, chosen)):
            top_k = to_device(ks, torch.long, device)
            top_p = to_device([max(p.top_p, 1.2e-38) for p in chosen], torch.float32, device)
            width = min(vocab, TOP_CANDIDATES)
            k_max = max(k for k in ks if k < vocab) if any(k < vocab for k in ks) else 0
            if all(p.top_p >= 1 for p in chosen) and 0 < k_max <= width:
                # top_k alone: the k-th best value (rows without a top_k have no floor).
                kth = scaled.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1)[:, None])
                floor = kth.squeeze(1).masked_fill(top_k >= vocab, float("-inf"))
            else:
                # Only a row with top_k beyond the candidates, or top_p without a top_k, can
                # need the whole row (and the host synchronisation that decides it).
                beyond = [width < k < vocab or (k == vocab and p.top_p < 1) for k, p in zip(ks, chosen)]
                floor = _truncation_floor(scaled, top_k, top_p, any(beyond))
        if any(p.min_p > 0 for p in chosen):
            # p >= min_p * p_max, with probabilities renormalised over the kept set: the same
            # inequality between logits, logit >= the best one + log(min_p).
            min_p = to_device([p.min_p for p in chosen], torch.float32, device)
            floor = torch.maximum(floor, scaled.amax(-1) + min_p.log())
        # A NaN logit (a broken model) makes a NaN floor: +inf instead, where the kernel, which
        # reads NaN as +inf, still finds that token.
        floor = torch.where(floor.isnan(), float("inf"), floor)
        out = torch.full((len(params),), float("-inf"), device=device)
        out[index] = floor
        return out

    @staticmethod
    def _apply_bias_and_penalties(logits, params, output_ids) -> torch.Tensor:
        vocab = logits.shape[-1]
        device = logits.device
        bias = [(i, tok, b) for i, p in enumerate(params) for tok, b in p.logit_bias.items()]
        penalised = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        if not bias and not penalised:
            return logits
        logits = logits.clone()
        if bias:
            rows, cols, values = zip(*bias)
            logits.index_put_(
                (to_device(rows, torch.long, device), to_device(cols, torch.long, device)),
                to_device(values, logits.dtype, device),
                accumulate=True,
            )
        if penalised:
            # Token counts per penalised row: scatter the generated ids (padded with an extra
            # column `vocab` that is dropped) into [rows, vocab + 1].
            width = max(1, max(len(output_ids[i]) for i in penalised))
            padded = [output_ids[i] + [vocab] * (width - len(output_ids[i])) for i in penalised]
            ids = to_device(padded, torch.long, device)
            counts = torch.zeros(len(penalised), vocab + 1, dtype=logits.dtype, device=device)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
            counts = counts[:, :vocab]
            freq = to_device([params[i].frequency_penalty for i in penalised], torch.float32, device)[:, None]
            pres = to_device([params[i].presence_penalty for i in penalised], torch.float32, device)[:, None]
            rows = to_device(penalised, torch.long, device)
            logits[rows] -= freq * counts + pres * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _truncated_probs(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax of [M, V] temperature-scaled logits with top_k / top_p / min_p applied."""
        device = scaled.device
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            vocab = scaled.shape[-1]
            top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, device)
            # At least float32's smallest normal: a top_p that rounds to 0 would drop the first token too.
            top_p = to_device([max(p.top_p, 1.2e-38) for p in params], torch.float32, device)
            scaled = _top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], torch.float32, device)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
            # A distribution again: the exponential race would not mind, rejection sampling does.
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    @classmethod
    def _logprobs(cls, logits, tokens, params) -> list[TokenLogprob | None]:
        """Each row's TokenLogprob of `tokens` [N] (None where the row wants none)."""
        parts = cls._logprob_tensors(logits, tokens, params)
        if parts is None:
            return [None] * len(params)
        host = HostCopy([tokens, *parts]).get()
        return cls._logprob_lists(host[0].tolist(), params, *host[1:])

    @staticmethod
    def _logprob_tensors(logits, tokens, params) -> list[torch.Tensor] | None:
        """For the M rows that want logprobs: [chosen [M], top values [M, k], top ids [M, k]] on
        the device (k: the most any row wants); None when no row wants them."""
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return None
        rows = to_device(wanted, torch.long, logits.device)
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        chosen = logprobs.gather(1, tokens[rows, None]).squeeze(1)
        k = max(params[i].logprobs for i in wanted)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return [chosen, top_values, top_ids]

    @staticmethod
    def _logprob_lists(token_list, params, chosen, top_values, top_ids) -> list[TokenLogprob | None]:
        """`_logprob_tensors`' host copies as TokenLogprobs; token_list: every row's token."""
        out: list[TokenLogprob | None] = [None] * len(params)
        chosen, top_values, top_ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        for j, i in enumerate(wanted):
            kk = params[i].logprobs
            out[i] = TokenLogprob(token_list[i], chosen[j], list(zip(top_ids[j][:kk], top_values[j][:kk])))
        return out


# The race's Philox keys are drawn from [0, RACE_KEY_END): 62 random bits a row and step.
RACE_KEY_END = 2**62

# top_k / top_p look at the best this many logits of a row first; a full sort of the vocabulary
# (201k entries) is needed only for rows whose kept set may reach past them.
TOP_CANDIDATES = 1024


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask [M, V] logits to each row's top_k, then to the smallest set ranked from the top whose
    renormalised mass reaches top_p (the first token always stays). top_k: [M] (V means off).

    Exact without sorting V when the kept set lies in the row's `TOP_CANDIDATES` best: true when
    top_k <= that many, or when top_k is off and those candidates already hold top_p of the mass.
    Other rows take the full sort."""
    vocab = scaled.shape[-1]
    width = min(vocab, TOP_CANDIDATES)
    values, order = scaled.topk(width, dim=-1)  # sorted, best first
    values = _top_values(values, top_k)
    # Renormalise over the top_k set: inside the candidates, or (top_k off) the whole row.
    log_total = torch.where(top_k <= width, values.logsumexp(-1), scaled.logsumexp(-1))
    kept, mass = _kept(values, top_k, top_p, log_total)
    out = torch.full_like(scaled, float("-inf")).scatter_(1, order, values.masked_fill(~kept, float("-inf")))
    fits = (top_k <= width) | ((top_k >= vocab) & (mass >= top_p))
    untouched = (top_k >= vocab) & (top_p >= 1)
    out = torch.where(untouched[:, None], scaled, out)
    slow = ~(fits | untouched)
    if bool(slow.any()):  # one host sync, only when some row truncates and the cheap check failed
        rows = slow.nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(scaled[rows], top_k[rows], top_p[rows])
    return out


def _truncation_floor(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, may_need_the_row: bool = True
) -> torch.Tensor:
    """[M] float32: each row of [M, V] scaled logits' least value kept by its top_k (V: off) and
    then top_p (renormalised over the top_k set; the first token always stays), as
    `_top_k_top_p_sorted` keeps them; -inf for rows with neither. From the row's
    `TOP_CANDIDATES` best when they settle it; the other rows take a full sort, after one host
    synchronisation that looks for them (only if may_need_the_row: some row has a top_k beyond
    the candidates, or a top_p and no top_k)."""
    vocab = scaled.shape[-1]
    width = min(vocab, TOP_CANDIDATES)
    values = _top_values(scaled.topk(width, dim=-1).values, top_k)  # sorted, best first
    in_candidates = top_k <= width
    if may_need_the_row:
        log_total = torch.where(in_candidates, values.logsumexp(-1), scaled.logsumexp(-1))
    else:
        log_total = values.logsumexp(-1)
    floor, mass = _cut(values, top_k, top_p, log_total)
    untouched = (top_k >= vocab) & (top_p >= 1)
    floor = floor.masked_fill(untouched, float("-inf"))
    if may_need_the_row:
        short = ~(in_candidates | untouched | ((top_k >= vocab) & (mass >= top_p)))
        if bool(short.any()):  # one host sync, only when some row may need more than the candidates
            rows = short.nonzero().squeeze(1)
            k = top_k[rows]
            ordered = _top_values(scaled[rows].sort(dim=-1, descending=True).values, k)
            floor[rows] = _cut(ordered, k, top_p[rows], ordered.logsumexp(-1))[0]
    return floor


def _top_values(values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Sorted rows [M, W] with the entries past each row's top_k set to -inf."""
    rank = torch.arange(values.shape[-1], device=values.device)[None, :]
    return values.masked_fill(rank >= top_k[:, None], float("-inf"))


def _kept(values: torch.Tensor, top_k, top_p, log_total) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted rows [M, W] (best first, -inf past each row's top_k: `_top_values`), top_k and
    top_p [M], log_total [M] (the log of the mass the probabilities are normalised by) -> (which
    entries are kept, [M, W] bool; the mass of the W entries within top_k, [M]). An entry is kept
    when it ranks within top_k and the mass ranked above it is below top_p."""
    probs = (values - log_total[:, None]).exp()
    mass_before = probs.cumsum(-1) - probs
    rank = torch.arange(values.shape[-1], device=values.device)[None, :]
    kept = (rank < top_k[:, None]) & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    return kept, probs.sum(-1)


def _cut(values: torch.Tensor, top_k, top_p, log_total) -> tuple[torch.Tensor, torch.Tensor]:
    """As `_kept` takes them -> (the value of the last entry kept, [M]; the mass of the W entries
    within top_k, [M])."""
    kept, mass = _kept(values, top_k, top_p, log_total)
    last = (kept.sum(-1) - 1).clamp_min(0)
    return values.gather(1, last[:, None]).squeeze(1), mass


def _top_k_top_p_sorted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_top_k_top_p` by a full sort of each row: the definition, and the fallback."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
