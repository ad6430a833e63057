"""Verification keeps the target's output distribution: the rejection sampler in isolation with
exact, known distributions, and the engine end to end on the tiny model.

The isolated tests drive `RejectionSampler.verify` the way the engine does, on a known target:
a Markov chain over a few tokens (the "model" gives p(next | previous)). Each round a drafter
guesses k tokens (deterministically, or sampled from its own distribution q), the target rows
are the chain's rows for the guessed prefix, and verify decides what is emitted. Many sequences
run side by side (deterministic seeds); the emitted texts' distribution is then compared with
the chain's exact one by a chi-square test at a 1e-4 false-alarm level, and the same counts are
shown to reject a plausible mistake (so the test has the power to fail).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from inference.request import SamplingParams
from inference.sample.rejection_sampler import RejectionSampler

V = 6  # chain states; logits for other ids are -inf-like


def chi2_limit(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) at the normal quantile z (Wilson-Hilferty; z=3.719: 1e-4)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, pooling cells expected below 5 into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def chain(seed: int) -> torch.Tensor:
    """Transition logits [V, V]: row i is log p(next | i); peaked enough that drafts often match."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5


def run_chain(
    logits: torch.Tensor,
    start: int,
    num_seqs: int,
    length: int,
    k: int,
    drafter: str,
    seed: int,
    params: SamplingParams,
) -> tuple[torch.Tensor, list[int]]:
    """Generate `length` tokens after `start` for num_seqs sequences with speculation.

    drafter: "argmax" (deterministic: the target's most likely token, so drafts are often kept),
    "sampled" (drafts sampled from a different chain, q passed to verify), "constant" (always 0).
    Returns the texts [num_seqs, length] and the per-step accepted counts."""
    torch.manual_seed(seed)
    draft_chain = torch.softmax(logits if drafter == "argmax" else chain(seed + 1000), -1)
    sampler = RejectionSampler()
    texts = [[start] for _ in range(num_seqs)]
    accepted_log = []
    generators = [None] * num_seqs
    while min(len(t) for t in texts) < length + 1:
        drafts, qs = [], []
        for t in texts:
            prev, guess, q = t[-1], [], []
            for _ in range(k):
                row = draft_chain[prev]
                if drafter == "sampled":
                    nxt = int(torch.multinomial(row, 1))
                    q.append(torch.cat([row, torch.zeros(8 - V)]))
                elif drafter == "constant":
                    nxt = 0
                else:
                    nxt = int(row.argmax())
                guess.append(nxt)
                prev = nxt
            drafts.append(guess)
            qs.append(torch.stack(q) if q else None)
        rows = []
        for t, guess in zip(texts, drafts):
            for prev in [t[-1]] + guess:
                rows.append(torch.cat([logits[prev], torch.full((8 - V,), -1e4)]))
        out = sampler.verify(
            torch.stack(rows),
            drafts,
            [params] * num_seqs,
            [[] for _ in texts],
            generators,
            draft_probs=qs if drafter == "sampled" else None,
        )
        for t, toks in zip(texts, out.token_ids):
            t.extend(toks)
        accepted_log.extend(out.num_accepted)
    return torch.tensor([t[1 : length + 1] for t in texts]), accepted_log


def pair_probs(logits: torch.Tensor, start: int, temperature: float = 1.0) -> torch.Tensor:
    p = torch.softmax(logits / temperature, -1)
    return (p[start][:, None] * p).flatten()  # P(x1 = i, x2 = j) = p(i|start) p(j|i)


@pytest.mark.parametrize("drafter", ["argmax", "sampled", "constant"])
def test_speculative_sampling_matches_the_target_chain(drafter):
    logits = chain(0)
    texts, accepted = run_chain(
        logits, start=2, num_seqs=4000, length=3, k=3, drafter=drafter, seed=1, params=SamplingParams(temperature=1.0)
    )
    # The first two emitted tokens, jointly (36 cells), and the third given the second (per-cell
    # margins follow from the chain too: test the pair (x2, x3)).
    pair = texts[:, 0] * V + texts[:, 1]
    counts = torch.bincount(pair, minlength=V * V).float()
    stat, df = chi2(counts, pair_probs(logits, 2))
    assert stat < chi2_limit(df), f"(x1, x2) chi2 {stat:.1f} over df {df}"
    p = torch.softmax(logits, -1)
    marginal2 = (p[2][:, None] * p).sum(0)  # P(x2 = i)
    pair23 = torch.bincount(texts[:, 1] * V + texts[:, 2], minlength=V * V).float()
    stat23, df23 = chi2(pair23, (marginal2[:, None] * p).flatten())
    assert stat23 < chi2_limit(df23), f"(x2, x3) chi2 {stat23:.1f} over df {df23}"
    # Drafts were really used: some kept, some rejected.
    assert 0 < sum(accepted) < 3 * len(accepted)
    # Power: the same counts reject a slightly different target (temperature 1.3).
    wrong, _ = chi2(counts, pair_probs(logits, 2, temperature=1.3))
    assert wrong > 2 * chi2_limit(df)


def test_a_sampler_that_keeps_drafts_too_often_is_caught():
    """The test above fails a broken verifier: keeping every deterministic draft (no rejection)."""
    logits = chain(0)

    class KeepEverything(RejectionSampler):
        def verify(self, logits, drafts, params, output_ids, generators, draft_probs=None):
            out = super().verify(logits, drafts, params, output_ids, generators, draft_probs)
            out.token_ids = [d + [t[-1]] if len(t) <= len(d) else t for d, t in zip(drafts, out.token_ids)]
            return out

    torch.manual_seed(1)
    sampler = KeepEverything()
    draft_chain = torch.softmax(chain(1001), -1)
    n = 3000
    rows = []
    drafts = []
    for _ in range(n):
        guess = [int(draft_chain[2].argmax())]
        drafts.append(guess)
        rows += [torch.cat([logits[2], torch.full((2,), -1e4)]), torch.cat([logits[guess[0]], torch.full((2,), -1e4)])]
    out = sampler.verify(torch.stack(rows), drafts, [SamplingParams()] * n, [[]] * n, [None] * n)
    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=V).float()
    stat, df = chi2(first, torch.softmax(logits[2], -1))
    assert stat > chi2_limit(df)


def test_greedy_keeps_the_drafts_that_match_the_argmax_then_corrects():
    logits = torch.full((4, 10), -5.0)
    best = [3, 7, 1, 4]  # the target's argmax at each row
    for r, t in enumerate(best):
        logits[r, t] = 5.0
    sampler = RejectionSampler()
    greedy = SamplingParams(temperature=0)
    cases = {  # drafts -> expected emitted tokens
        (3, 7, 1): [3, 7, 1, 4],  # all kept, plus the bonus token
        (3, 2, 1): [3, 7],  # second draft wrong: corrected, the rest dropped
        (9, 7, 1): [3],
    }
    for drafts, expected in cases.items():
        out = sampler.verify(logits, [list(drafts)], [greedy], [[]], [None])
        assert out.token_ids == [expected] and out.num_accepted == [len(expected) - 1]


def test_rows_apply_penalties_as_if_the_drafts_were_generated():
    """After keeping draft 3, row 1 must count 3 as generated: with a presence penalty of 2 its
    choice moves from 3 (logit 5) to 6 (logit 4), as plain decoding's would."""
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    logits[:, 6] = 4.0
    sampler = RejectionSampler()
    plain = sampler.verify(logits, [[3]], [SamplingParams(temperature=0)], [[]], [None])
    assert plain.token_ids == [[3, 3]]
    penalised = sampler.verify(logits, [[3]], [SamplingParams(temperature=0, presence_penalty=2.0)], [[]], [None])
    assert penalised.token_ids == [[3, 6]]
    # Earlier output counts as well: 3 generated before this step is penalised at row 0 already.
    earlier = sampler.verify(logits, [[3]], [SamplingParams(temperature=0, presence_penalty=2.0)], [[3]], [None])
    assert earlier.token_ids == [[6]]


def test_drafts_outside_top_k_are_always_rejected():
    torch.manual_seed(0)
    logits = torch.randn(2, 50).expand(400, 2, 50).reshape(800, 50).clone()
    top2 = set(logits[0].topk(2).indices.tolist())
    outside = next(t for t in range(50) if t not in top2)
    params = SamplingParams(temperature=1.0, top_k=2)
    out = RejectionSampler().verify(logits, [[outside]] * 400, [params] * 400, [[]] * 400, [None] * 400)
    assert all(n == 0 for n in out.num_accepted)
    assert {t[0] for t in out.token_ids} <= top2


def test_seeded_requests_verify_reproducibly_and_return_logprobs():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.8, seed=7, logprobs=2)

    def once():
        g = torch.Generator().manual_seed(7)
        return RejectionSampler().verify(logits, [[4, 9]], [params], [[]], [g])

    a, b = once(), once()
    assert a.token_ids == b.token_ids
    lps = a.logprobs[0]
    assert [lp.token_id for lp in lps] == a.token_ids[0]
    raw = torch.log_softmax(logits, -1)
    for row, lp in enumerate(lps):  # logprobs of the raw distribution at each emitted position
        assert lp.logprob == pytest.approx(float(raw[row, lp.token_id]), abs=1e-5)
        assert len(lp.top) == 2


# -- end to end: the engine on the tiny model --------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """The tiny model with a 256-token vocabulary: logits for thousands of rows stay cheap."""
    from inference.model.gpt_oss import GptOssModel
    from inference.model.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-spec-sampling"), seed=0, vocab_size=256)
    return GptOssModel.from_pretrained(path, device="cpu")


def test_engine_sampling_with_ngram_drafts_matches_the_model(small_vocab_model):
    """Temperature 1 over four tokens (logit_bias lifts them far above the rest): the prompt's
    n-grams recur, so most steps verify drafts. The joint distribution of the first two generated
    tokens over many requests must match the model's exact probabilities (teacher forcing)."""
    from inference.config import EngineConfig
    from inference.engine.core import LLMEngine
    from inference.request import GenerationRequest
    from inference.runner.single_sequence import SingleSequenceCache

    model = small_vocab_model
    words = [11, 22, 33, 44]
    bias = {w: 40.0 for w in words}
    rng = random.Random(3)
    prompt = [rng.choice(words) for _ in range(24)]
    n = 600

    def engine(**options):
        return LLMEngine(model, EngineConfig(page_size=8, speculative="ngram", num_draft_tokens=3, **options))

    def sampling(seed):
        return SamplingParams(temperature=1.0, max_tokens=3, logit_bias=bias, seed=seed)

    eng = engine(num_pages=4096, max_num_seqs=n, max_num_batched_tokens=1 << 15)
    for i in range(n):
        eng.add_request(GenerationRequest(str(i), prompt, sampling(i)))
    texts: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            texts.setdefault(d.request_id, []).extend(d.token_ids)
    stats = eng.stats()
    assert stats.spec_steps > n // 2 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens

    def next_probs(context: list[int]) -> torch.Tensor:
        cache = SingleSequenceCache(model, len(context) + 1)
        logits = cache.forward(context)[-1].clone()
        logits[torch.tensor(words)] += 40.0
        return torch.softmax(logits.double(), -1)[torch.tensor(words)]

    first = next_probs(prompt)
    expected = torch.cat([first[i] * next_probs(prompt + [w]) for i, w in enumerate(words)])
    index = {w: i for i, w in enumerate(words)}
    cells = torch.tensor([index[t[0]] * 4 + index[t[1]] for t in texts.values()])
    counts = torch.bincount(cells, minlength=16).double()
    stat, df = chi2(counts, expected / expected.sum())
    assert stat < chi2_limit(df), f"chi2 {stat:.1f} over df {df}"
    # Power: the first token's distribution differs from, e.g., the second's after the same word.
    wrong, _ = chi2(torch.bincount(cells // 4, minlength=4).double(), next_probs(prompt + [words[0]]))
    assert wrong > chi2_limit(3)
    # Seeded: the same seed gives the same text with the same drafter, whatever else runs.
    again = engine(num_pages=512)
    again.add_request(GenerationRequest("again", prompt, sampling(5)))
    out = []
    while again.has_unfinished():
        for d in again.step():
            out.extend(d.token_ids)
    assert out == texts["5"]


def test_min_p_verification_keeps_the_target_distribution():
    """min_p zeroes tokens; what is left must be renormalised before drafts are accepted with
    probability p(draft), or accepted drafts come out too rarely. Target [0.4, 0.35, 0.25] with
    min_p 0.7 keeps [0.533, 0.467, 0]; always drafting token 1 must give it 0.467 of the time."""
    from inference.sample.rejection_sampler import RejectionSampler

    probs = torch.tensor([0.4, 0.35, 0.25])
    n = 20_000
    torch.manual_seed(0)
    logits = probs.log().repeat(2 * n, 1)  # per sequence: the draft's row and the bonus row
    out = RejectionSampler().verify(
        logits, [[1]] * n, [SamplingParams(temperature=1.0, min_p=0.7)] * n, [[]] * n, [None] * n
    )
    first = torch.tensor([t[0] for t in out.token_ids])
    assert abs(float((first == 1).float().mean()) - 0.35 / 0.75) < 0.02
    assert not bool((first == 2).any())
