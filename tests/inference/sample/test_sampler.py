"""Each sampling parameter changes what the sampler returns, in the documented way."""

from __future__ import annotations

import math

import pytest
import torch

from inference.request import SamplingParams
from inference.sample.sampler import Sampler

V = 50


def run(logits, params, outputs=None, generators=None):
    n = logits.shape[0]
    return Sampler()(logits, params, outputs or [[] for _ in range(n)], generators or [None] * n)


def probs_logits(probs: list[float]) -> torch.Tensor:
    """Logits [V] giving these probabilities to the first tokens and ~0 to the rest."""
    p = torch.full((V,), 1e-9)
    p[: len(probs)] = torch.tensor(probs)
    return p.log()


def frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    torch.manual_seed(0)
    out = run(logits_row.expand(n, V).clone(), [params] * n).token_ids
    return torch.bincount(torch.tensor(out), minlength=V).float() / n


def test_greedy_takes_the_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    out = run(logits, [SamplingParams(temperature=0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_vanishing_temperature_and_top_p_pick_the_argmax():
    # 1e-45 rounds to 0 in float32 and 1e-40 overflows the scaled logits: both are as greedy as
    # the limit they tend to, not garbage. A top_p that rounds to 0 keeps the first token.
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2)) * 30
    params = [SamplingParams(temperature=t) for t in (1e-45, 1e-40, 1e-6)]
    params += [SamplingParams(top_p=p) for p in (1e-50, 1e-45, 1e-39)]
    assert run(logits, params).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_samples_follow_the_tempered_distribution(temperature):
    logits = torch.linspace(4.0, -4.0, V)
    freq = frequencies(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(logits / temperature, -1)
    assert (freq - expected).abs().max() < 0.03
    # A wrong temperature would be visible: compare with temperature 1's distribution.
    if temperature != 1.0:
        assert (torch.softmax(logits, -1) - expected).abs().max() > 0.06


def test_top_k_keeps_only_the_k_best():
    logits = torch.linspace(1.0, 0.0, V)  # nearly flat
    freq = frequencies(logits, SamplingParams(top_k=3))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = probs_logits([0.5, 0.3, 0.1, 0.05, 0.05])
    freq = frequencies(logits, SamplingParams(top_p=0.75))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1}
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.03


def test_min_p_drops_unlikely_tokens():
    logits = probs_logits([0.5, 0.3, 0.1, 0.1])
    freq = frequencies(logits, SamplingParams(min_p=0.3))  # threshold 0.15
    assert set(freq.nonzero().flatten().tolist()) == {0, 1}


def test_top_k_and_top_p_per_row_in_one_batch():
    logits = torch.linspace(1.0, 0.0, V).expand(3, V).clone()
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(temperature=0)]
    for _ in range(20):
        out = run(logits, params).token_ids
        assert out[0] == 0 and out[2] == 0


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_same_seed_same_tokens_whatever_the_batch():
    flat = torch.zeros(V)
    params = SamplingParams(seed=42)
    alone_gen, batched_gen = seeded(42), seeded(42)
    alone, batched = [], []
    for step in range(10):
        alone.append(run(flat[None].clone(), [params], generators=[alone_gen]).token_ids[0])
        # Same request at another row, next to unseeded and differently seeded neighbours.
        logits = torch.randn(3, V)
        logits[1] = flat
        out = run(
            logits, [SamplingParams(), params, SamplingParams(seed=7)], generators=[None, batched_gen, seeded(step)]
        )
        batched.append(out.token_ids[1])
    assert alone == batched
    other_gen = seeded(43)
    other = [run(flat[None].clone(), [SamplingParams(seed=43)], generators=[other_gen]).token_ids[0] for _ in range(10)]
    assert other != alone


def test_frequency_penalty_scales_with_count():
    logits = torch.zeros(1, V)
    logits[0, 0], logits[0, 1] = 1.0, 0.0  # token 0 leads by 1
    history = [[0, 0, 0]]
    greedy = dict(temperature=0)
    assert run(logits, [SamplingParams(**greedy)], history).token_ids == [0]
    assert run(logits, [SamplingParams(frequency_penalty=0.2, **greedy)], history).token_ids == [0]  # 0.6 < 1
    assert run(logits, [SamplingParams(frequency_penalty=0.5, **greedy)], history).token_ids == [1]  # 1.5 > 1
    # Negative penalties favour repetition.
    logits2 = logits.clone()
    logits2[0, 2] = 1.5
    assert run(logits2, [SamplingParams(frequency_penalty=-0.5, **greedy)], history).token_ids == [0]


def test_presence_penalty_ignores_count():
    logits = torch.zeros(1, V)
    logits[0, 0] = 1.0
    history = [[0, 0, 0]]
    assert run(logits, [SamplingParams(presence_penalty=0.6, temperature=0)], history).token_ids == [0]
    assert run(logits, [SamplingParams(presence_penalty=1.5, temperature=0)], history).token_ids == [1]
    # Only rows with history are penalised.
    two = logits.expand(2, V).clone()
    out = run(two, [SamplingParams(presence_penalty=1.5, temperature=0)] * 2, [[0], []])
    assert out.token_ids == [1, 0]


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1).tolist()
    out = run(
        logits,
        [
            SamplingParams(temperature=0, logit_bias={7: 100.0}),
            SamplingParams(temperature=0, logit_bias={best[1]: -100.0}),
        ],
    )
    assert out.token_ids[0] == 7
    assert out.token_ids[1] != best[1]
    # With sampling too: a banned token never appears.
    freq = frequencies(torch.zeros(V), SamplingParams(logit_bias={t: -100.0 for t in range(V - 1)}), n=200)
    assert freq[V - 1] == 1.0


def test_logprobs_are_the_raw_model_distribution():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.7, logprobs=0),
        SamplingParams(temperature=0),
    ]
    out = run(logits, params)
    ref = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, ref[0, first.token_id].item(), rel_tol=1e-5)
    top_ids = ref[0].topk(3).indices.tolist()
    assert [t for t, _ in first.top] == top_ids
    assert all(math.isclose(lp, ref[0, t].item(), rel_tol=1e-5) for t, lp in first.top)
    second = out.logprobs[1]
    assert second.top == [] and math.isclose(second.logprob, ref[1, out.token_ids[1]].item(), rel_tol=1e-5)
    assert out.logprobs[2] is None


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_top_k_top_p_without_a_sort_equals_the_sorted_definition(temperature):
    """The candidate-based mask equals the full-sort definition on every kind of row: top_k inside
    and beyond the candidates, top_p reached inside them (peaked rows) and not (flat rows)."""
    from inference.sample.sampler import TOP_CANDIDATES, _top_k_top_p, _top_k_top_p_sorted

    g = torch.Generator().manual_seed(0)
    vocab = 5000
    logits = torch.randn(8, vocab, generator=g) / temperature
    logits[::2] *= 6  # peaked rows: the candidates hold most of the mass
    top_k = torch.tensor([0, 0, 40, 40, TOP_CANDIDATES + 300, 0, vocab, 3])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.7, 0.95, 1.0, 0.999, 0.2])
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    fast, reference = _top_k_top_p(logits, k, top_p), _top_k_top_p_sorted(logits, k, top_p)
    assert torch.equal(torch.isinf(fast), torch.isinf(reference))
    kept = ~torch.isinf(reference)
    assert torch.equal(fast[kept], reference[kept])
    # Row 5 truncates nothing; row 2 keeps exactly its top 40.
    assert kept[5].all() and int(kept[2].sum()) == 40


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_truncation_floor_is_the_least_logit_the_definition_keeps(temperature):
    """The race's floor (`_truncation_floor`) is the least logit `_top_k_top_p_sorted` keeps, on
    rows settled by the candidates and on rows that need the whole row; without top_k or top_p
    there is no floor. Without rows that may need the whole row it settles from the candidates."""
    from inference.sample.sampler import TOP_CANDIDATES, _top_k_top_p_sorted, _truncation_floor

    g = torch.Generator().manual_seed(0)
    vocab = 5000
    logits = torch.randn(8, vocab, generator=g) / temperature
    logits[::2] *= 6
    top_k = torch.tensor([0, 0, 40, 40, TOP_CANDIDATES + 300, 0, vocab, 3])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.7, 0.95, 1.0, 0.999, 0.2])
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    kept = _top_k_top_p_sorted(logits, k, top_p)
    least = kept.masked_fill(torch.isinf(kept), float("inf")).amin(-1)
    floor = _truncation_floor(logits, k, top_p)
    assert floor[5].item() == float("-inf")
    others = [0, 1, 2, 3, 4, 6, 7]
    assert torch.equal(floor[others], least[others])
    assert ((logits >= floor[:, None]) == ~torch.isinf(kept))[others].all()  # no ties here
    settled = [2, 3, 7]  # top_k within the candidates
    assert torch.equal(_truncation_floor(logits[settled], k[settled], top_p[settled], False), least[settled])


def test_race_floors_follow_each_truncation():
    """`Sampler._floors` (the race's thresholds, torch ops only): top_k among -inf-masked logits,
    top_k past the candidates, top_k at or past the vocabulary (no floor), min_p 1 (the best
    only), top_p with min_p, rows without truncation, and a NaN logit (+inf, its token)."""
    from inference.sample.sampler import TOP_CANDIDATES, _top_k_top_p_sorted

    g = torch.Generator().manual_seed(3)
    vocab = 3000
    logits = torch.randn(7, vocab, generator=g) * 2
    logits[0, ::2] = float("-inf")
    logits[6, 17] = float("nan")
    params = [
        SamplingParams(top_k=40),
        SamplingParams(top_k=TOP_CANDIDATES + 100),
        SamplingParams(top_k=vocab + 5),
        SamplingParams(min_p=1.0),
        SamplingParams(top_p=0.6, min_p=0.2, temperature=0.7),
        SamplingParams(),
        SamplingParams(top_k=5),
    ]
    inv_temp = torch.tensor([1 / p.temperature for p in params])
    floors = Sampler._floors(logits, inv_temp, params, [0, 1, 2, 3, 4, 6])
    scaled = logits * inv_temp[:, None]
    assert (scaled[0] >= floors[0]).sum() == 40 and torch.isfinite(floors[0])
    assert (scaled[1] >= floors[1]).sum() == TOP_CANDIDATES + 100
    assert floors[2].item() == float("-inf") and floors[5].item() == float("-inf")
    assert floors[3] == scaled[3].max()
    kept = _top_k_top_p_sorted(scaled[4:5], torch.tensor([vocab]), torch.tensor([0.6]))[0]
    least = kept[~torch.isinf(kept)].min()
    assert floors[4] == torch.maximum(least, scaled[4].max() + math.log(0.2))
    assert floors[6].item() == float("inf")
