"""The sampler with its one-pass race (the CUDA path whenever a row is sampled), on a GPU or
under Triton's interpreter: the same contract as the torch ops in test_sampler.py."""

from __future__ import annotations

import pytest
import torch

from inference.request import SamplingParams  # noqa: E402
from inference.sample import sampler as sampler_module  # noqa: E402
from inference.sample.sampler import Sampler  # noqa: E402
from tests.triton_interpreter import (  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)
    DEVICE,
    fresh_process_only,
    kernel_module,
    needs_triton,
    run_in_fresh_interpreter,
)

V = 50


@fresh_process_only
def test_triton_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


@pytest.fixture
def races(monkeypatch):
    """Route the sampler's raced rows to the kernels (interpreted on CPU, where the sampler would
    otherwise take the torch ops) and count the calls. Rows here are 50 wide: 64-column chunks
    (the interpreter's time goes by the chunk, not the row)."""
    kernels = kernel_module("inference.sample.argmax_triton", "_race_partial_kernel")
    monkeypatch.setattr(kernels, "CHUNK", 64)
    calls = []

    def race(x, inv_temp, keys, floors=None):
        calls.append(inv_temp.tolist())
        return kernels.race_argmax_rows_triton(x, inv_temp, keys, floors)

    monkeypatch.setattr(sampler_module, "on_triton", lambda x: x.dim() == 2 and x.stride(1) == 1)
    monkeypatch.setattr(sampler_module, "race_argmax_rows_triton", race)
    return calls


def run(logits, params, generators=None):
    n = logits.shape[0]
    return Sampler()(logits.to(DEVICE), params, [[] for _ in range(n)], generators or [None] * n).token_ids


@needs_triton
def test_triton_race_follows_the_tempered_distribution(races):
    """Drawn at temperature 0.5 (a few hundred rows: the interpreter takes ~40 ms a program), the
    tokens' distribution is softmax(logits / 0.5)'s (Kolmogorov-Smirnov distance under 0.1,
    about the 0.1% critical value) and not softmax(logits)'s."""
    n, temperature = 400, 0.5
    logits = torch.linspace(4.0, -4.0, V)
    torch.manual_seed(0)
    out = run(logits.expand(n, V).clone(), [SamplingParams(temperature=temperature)] * n)
    assert len(races) == 1 and races[0][0] == pytest.approx(1 / temperature)
    drawn = (torch.bincount(torch.tensor(out), minlength=V).float() / n).cumsum(0)
    expected = torch.softmax(logits / temperature, -1).cumsum(0)
    assert (drawn - expected).abs().max() < 0.1
    assert (drawn - torch.softmax(logits, -1).cumsum(0)).abs().max() > 0.2


@needs_triton
def test_triton_race_beside_greedy_and_truncating_rows(races):
    """Greedy rows take their argmax and truncating rows their cut, in the same launch."""
    logits = torch.linspace(1.0, 0.0, V).expand(4, V).clone()  # nearly flat
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_k=3)]
    raced, top_3 = set(), set()
    torch.manual_seed(2)
    for _ in range(20):
        out = run(logits, params)
        assert out[0] == 0 and out[1] == 0
        raced.add(out[2])
        top_3.add(out[3])
    assert len(raced) > 5 and top_3 == {0, 1, 2}
    assert all(r == [0.0, 0.0, 1.0, 1.0] for r in races)  # top_k 1: the argmax
    races.clear()
    assert run(logits, [SamplingParams(temperature=0)] * 4) == [0] * 4 and not races  # no sampled row


@needs_triton
def test_triton_race_top_k_1_is_the_first_argmax(races):
    """top_k 1 among tied best logits (bf16 logits tie) takes the first, as greedy does."""
    logits = torch.zeros(6, V)
    logits[:, [4, 9, 30]] = 2.0
    assert run(logits, [SamplingParams(top_k=1)] * 3 + [SamplingParams(top_k=1, temperature=3.0)] * 3) == [4] * 6


def probs_logits(probs: list[float]) -> torch.Tensor:
    """Logits [V] giving these probabilities to the first tokens and ~0 to the rest."""
    p = torch.full((V,), 1e-9)
    p[: len(probs)] = torch.tensor(probs)
    return p.log()


@needs_triton
def test_triton_race_truncates_as_top_k_top_p_and_min_p_say(races):
    """One launch, 150 rows each: top_k 3 of nearly flat logits draws only the 3 best; top_p 0.75
    of (0.5, 0.3, 0.1, ...) only the first two, in proportion 5:3; min_p 0.3 of (0.5, 0.3, 0.1,
    0.1) only the first two; at temperature 2, top_k 2 the two best, evenly enough."""
    n = 150
    cases = [
        (torch.linspace(1.0, 0.0, V), SamplingParams(top_k=3)),
        (probs_logits([0.5, 0.3, 0.1, 0.05, 0.05]), SamplingParams(top_p=0.75)),
        (probs_logits([0.5, 0.3, 0.1, 0.1]), SamplingParams(min_p=0.3)),
        (probs_logits([0.4, 0.35, 0.25]), SamplingParams(temperature=2.0, top_k=2)),
    ]
    logits = torch.cat([row.expand(n, V) for row, _ in cases])
    torch.manual_seed(1)
    out = torch.tensor(run(logits, [p for _, p in cases for _ in range(n)])).view(len(cases), n)
    assert len(races) == 1
    assert set(out[0].tolist()) == {0, 1, 2}
    assert set(out[1].tolist()) == {0, 1} and abs((out[1] == 0).float().mean().item() - 0.625) < 0.12
    assert set(out[2].tolist()) == {0, 1}
    assert set(out[3].tolist()) == {0, 1} and 0.35 < (out[3] == 0).float().mean().item() < 0.7


@needs_triton
def test_triton_race_same_seed_same_tokens_whatever_the_batch(races):
    def seeded(seed: int) -> torch.Generator:
        return torch.Generator(device=DEVICE).manual_seed(seed)

    flat = torch.zeros(V)
    params = SamplingParams(seed=42)
    alone_gen, batched_gen = seeded(42), seeded(42)
    alone, batched = [], []
    for step in range(10):
        alone.append(run(flat[None].clone(), [params], [alone_gen])[0])
        logits = torch.randn(3, V)
        logits[1] = flat
        batch = [SamplingParams(), params, SamplingParams(seed=7)]
        batched.append(run(logits, batch, [None, batched_gen, seeded(step)])[1])
    assert alone == batched
    other_gen = seeded(43)
    assert [run(flat[None].clone(), [SamplingParams(seed=43)], [other_gen])[0] for _ in range(10)] != alone


@needs_triton
def test_triton_race_after_logit_bias(races):
    bias = {t: -100.0 for t in range(V - 1)}
    out = run(torch.zeros(50, V), [SamplingParams(logit_bias=bias)] * 50)
    assert races and set(out) == {V - 1}
