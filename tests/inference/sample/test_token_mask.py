"""Grammar masks in the samplers (`inference/sample/token_mask.py`): only the masked rows change,
and nothing a mask disallows is ever drawn, plain or verifying drafts."""

from __future__ import annotations

import torch

from inference.request import SamplingParams
from inference.sample.rejection_sampler import RejectionSampler
from inference.sample.sampler import Sampler
from inference.sample.token_mask import TokenMasks, apply_token_masks

V = 70  # not a multiple of 32: the last word is partly padding


def bitmask(allowed_rows: list[set[int]]) -> torch.Tensor:
    words = (V + 31) // 32
    bits = torch.zeros(len(allowed_rows), words * 32, dtype=torch.bool)
    for i, allowed in enumerate(allowed_rows):
        bits[i, list(allowed)] = True
    weights = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int64)
    packed = (bits.view(len(allowed_rows), words, 32).long() * weights).sum(-1)
    return packed.to(torch.int32)  # (bit 31 wraps to int32's sign bit, as llguidance writes it)


def test_masks_set_exactly_the_disallowed_tokens_of_their_rows_to_minus_infinity():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    before = logits.clone()
    allowed = [{0, 31, 32, 63, 69}, set(range(V)) - {5}]
    out = apply_token_masks(logits, TokenMasks([1, 3], bitmask(allowed)))
    assert torch.equal(logits, before)  # a copy
    for row, keep in zip([1, 3], allowed):
        expected = torch.full((V,), float("-inf"))
        expected[list(keep)] = before[row, list(keep)]
        assert torch.equal(out[row], expected)
    assert torch.equal(out[[0, 2]], before[[0, 2]])
    every = apply_token_masks(logits, TokenMasks([0, 1, 2, 3], bitmask([{7}] * 4)))
    assert (every.argmax(-1) == 7).all() and torch.isinf(every).sum() == 4 * (V - 1)


def run(logits, params, masks=None):
    n = logits.shape[0]
    return Sampler()(logits, params, [[] for _ in range(n)], [None] * n, masks)


def test_greedy_rows_take_their_best_allowed_token_and_other_rows_are_unchanged():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    greedy = [SamplingParams(temperature=0, logprobs=2)] * 3
    plain = run(logits, greedy)
    allowed = {3, 40, 66}
    masked = run(logits, greedy, TokenMasks([1], bitmask([allowed])))
    assert masked.token_ids[1] == max(allowed, key=lambda t: logits[1, t].item())
    assert masked.token_ids[0] == plain.token_ids[0] and masked.token_ids[2] == plain.token_ids[2]
    # Logprobs are the model's own, before the mask, as without one.
    assert masked.logprobs[1].top == plain.logprobs[1].top


def test_sampled_rows_never_draw_a_disallowed_token():
    torch.manual_seed(0)
    n = 2000
    logits = torch.randn(1, V).expand(n, V).clone()
    allowed = {2, 33, 64}
    out = run(
        logits, [SamplingParams(temperature=1.5, top_p=0.9)] * n, TokenMasks(list(range(n)), bitmask([allowed] * n))
    )
    assert set(out.token_ids) == allowed  # each drawn, and nothing else


def test_verification_keeps_drafts_and_draws_replacements_among_allowed_tokens_only():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(V, generator=g)
    best = int(base.argmax())
    second = int(base.topk(2).indices[1])
    # One sequence, two drafts: rows 0..2. The model's own best is disallowed at row 0; the
    # drafts are what the grammar allows best; row 2 allows only token 9.
    logits = base.expand(3, V).clone()
    rows = [set(range(V)) - {best}, set(range(V)), {9}]
    masks = TokenMasks([0, 1, 2], bitmask(rows))
    out = RejectionSampler().verify(
        logits, [[second, best]], [SamplingParams(temperature=0)], [[]], [None], masks=masks
    )
    assert out.token_ids == [[second, best, 9]] and out.num_accepted == [2]
    # Sampling: whatever is kept or drawn, every emitted token is allowed at its row.
    torch.manual_seed(1)
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        out = RejectionSampler().verify(
            logits, [[second, best]], [SamplingParams(temperature=1.0, seed=seed)], [[]], [gen], masks=masks
        )
        for i, token in enumerate(out.token_ids[0]):
            assert token in rows[i], (seed, i, token)
