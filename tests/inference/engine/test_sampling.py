"""Every sampling parameter, run through `LLMEngine` on the tiny random model.

`tests/inference/sample/test_sampler.py` checks the sampler on hand-made logits; these tests check that the
engine hands each parameter (and, for penalties, each sequence's generated tokens) to it. The
oracle is the model itself: the logits the engine sampled from are recomputed with
`SingleSequenceCache` over the prompt plus the engine's own output, and every emitted token must
satisfy the parameter there. Each test also runs the same request with the parameter at its
neutral value (same seed, same batch) and asserts the two runs differ, so a test cannot pass with
the parameter silently dropped.

The tiny model's next-token distribution is nearly flat at temperature 1 (p_max ~ 3e-4 over 201k
tokens); at temperature 0.2 about half the mass sits on a handful of tokens, which is where
top_p and min_p have something to cut. Stop token ids and max_tokens are covered by
`test_engine_core.py::test_stop_tokens_and_max_tokens`, seeds across batches by
`test_engine_core.py::test_seed_reproduces_whatever_else_runs`.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from inference.config import EngineConfig
from inference.engine.core import LLMEngine
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from inference.request import GenerationRequest, SamplingParams
from inference.runner.single_sequence import SingleSequenceCache
from tests.engine_runs import drain, tokens_of

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-sampling"), seed=0)
    return GptOssModel.from_pretrained(path, device="cpu")


def prompt(seed: int, length: int = 9) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(length)]


def run(model, ids: list[int], *settings: dict) -> list[list[int]]:
    """Run one request per `settings` (SamplingParams fields) in one engine batch; their tokens."""
    eng = LLMEngine(model, EngineConfig(num_pages=64))
    for i, s in enumerate(settings):
        eng.add_request(GenerationRequest(str(i), list(ids), SamplingParams(**{"max_tokens": NUM_TOKENS, **s})))
    out = drain(eng)
    return [tokens_of(out[str(i)]) for i in range(len(settings))]


@torch.inference_mode()
def logits_along(model, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] the model's logits for each of `tokens`, given the prompt and the tokens before it."""
    cache = SingleSequenceCache(model, len(ids) + len(tokens))
    return cache.forward(ids + tokens[:-1])[len(ids) - 1 :].float()


def greedy_mismatches(logits: torch.Tensor, tokens: list[int], process) -> list[int]:
    """Positions where `tokens` is not greedy decoding under `process(logits [V], generated) ->
    logits`; `logits` from `logits_along`. Empty: the tokens are exactly that greedy output."""
    return [
        i
        for i, (row, token) in enumerate(zip(logits, tokens))
        if int(process(row.clone(), tokens[:i]).argmax()) != token
    ]


def counts(generated: list[int], vocab: int) -> torch.Tensor:
    c = torch.zeros(vocab)
    for token, n in Counter(generated).items():
        c[token] = n
    return c


def plain(logits, generated):
    return logits


def frequency(penalty):
    return lambda logits, generated: logits - penalty * counts(generated, logits.shape[-1])


def presence(penalty):
    return lambda logits, generated: logits - penalty * (counts(generated, logits.shape[-1]) > 0).float()


# --- penalties and bias: greedy, so each token must be the argmax of the edited logits ------
# The tiny model's greedy output never repeats a token, so a positive penalty alone would change
# nothing; a negative one (a reward for repeating) changes the output as soon as the generated
# tokens reach the sampler. At -2 here a token's reward grows with its count (frequency) or not
# (presence), and the two outputs differ.


def test_frequency_penalty_counts_every_generated_token(model):
    ids = prompt(1)
    penalised, untouched = run(model, ids, dict(temperature=0, frequency_penalty=-2.0), dict(temperature=0))
    logits = logits_along(model, ids, penalised)
    assert greedy_mismatches(logits, penalised, frequency(-2.0)) == []
    assert greedy_mismatches(logits, penalised, plain)  # the penalty (and the history it needs) was used
    assert greedy_mismatches(logits, penalised, presence(-2.0))  # per occurrence, not once per token
    assert greedy_mismatches(logits_along(model, ids, untouched), untouched, plain) == []


def test_presence_penalty_counts_each_token_once(model):
    ids = prompt(1)
    (penalised,) = run(model, ids, dict(temperature=0, presence_penalty=-2.0))
    logits = logits_along(model, ids, penalised)
    assert greedy_mismatches(logits, penalised, presence(-2.0)) == []
    assert greedy_mismatches(logits, penalised, plain)
    assert greedy_mismatches(logits, penalised, frequency(-2.0))


def test_positive_penalties_push_repeats_away(model):
    # A presence reward makes greedy repeat; a larger frequency penalty on top forbids repeats.
    ids = prompt(2)
    rewarded, both = run(
        model,
        ids,
        dict(temperature=0, presence_penalty=-20.0),
        dict(temperature=0, presence_penalty=-20.0, frequency_penalty=40.0),
    )
    assert len(set(rewarded)) < len(rewarded)
    assert len(set(both)) == len(both)
    combined = lambda row, generated: frequency(40.0)(presence(-20.0)(row, generated), generated)  # noqa: E731
    assert greedy_mismatches(logits_along(model, ids, both), both, combined) == []


def test_logit_bias_shifts_the_logits(model):
    ids = prompt(3)
    (greedy,) = run(model, ids, dict(temperature=0))
    # Forbid the third greedy token and lift another a little: the output changes from there on,
    # but the lifted token does not take over every step (the bias is added, not forced).
    bias = {greedy[2]: -100.0, 777: 1.0}

    def biased(row, generated):
        for token, value in bias.items():
            row[token] += value
        return row

    (out,) = run(model, ids, dict(temperature=0, logit_bias=bias))
    assert greedy_mismatches(logits_along(model, ids, out), out, biased) == []
    assert out[:2] == greedy[:2] and out[2] != greedy[2] and greedy[2] not in out


# --- truncation: sampled, so each token is checked against the distribution it came from ---


def ranks(logits: torch.Tensor, tokens: list[int]) -> list[int]:
    """Each token's rank (0 = most likely) in its row of logits."""
    return [int((row > row[t]).sum()) for row, t in zip(logits, tokens)]


def test_top_k_keeps_the_k_best(model):
    ids = prompt(4)
    kept, untruncated = run(model, ids, dict(temperature=1.0, top_k=3, seed=11), dict(temperature=1.0, seed=11))
    kept_ranks = ranks(logits_along(model, ids, kept), kept)
    assert max(kept_ranks) < 3
    assert max(kept_ranks) > 0  # sampled, not greedy
    assert max(ranks(logits_along(model, ids, untruncated), untruncated)) >= 3  # without top_k it strays


def nucleus_size(logits: torch.Tensor, temperature: float, top_p: float) -> list[int]:
    """Per row, how many of the best tokens the smallest set with mass >= top_p holds."""
    probs = (logits / temperature).softmax(-1).sort(-1, descending=True).values
    mass_before = probs.cumsum(-1) - probs
    return (mass_before < top_p).sum(-1).tolist()


def test_top_p_keeps_the_nucleus(model):
    ids = prompt(5)
    settings = dict(temperature=0.2, seed=5)
    kept, untruncated = run(model, ids, dict(settings, top_p=0.4), settings)
    logits = logits_along(model, ids, kept)
    assert all(r < n for r, n in zip(ranks(logits, kept), nucleus_size(logits, 0.2, 0.4)))
    assert max(ranks(logits, kept)) > 0
    logits = logits_along(model, ids, untruncated)
    assert any(r >= n for r, n in zip(ranks(logits, untruncated), nucleus_size(logits, 0.2, 0.4)))


def relative_probs(logits: torch.Tensor, tokens: list[int], temperature: float) -> list[float]:
    """Each token's probability divided by its row's largest probability."""
    probs = (logits / temperature).softmax(-1)
    return [float(row[t] / row.max()) for row, t in zip(probs, tokens)]


def test_min_p_drops_unlikely_tokens(model):
    ids = prompt(6)
    settings = dict(temperature=0.2, seed=6)
    kept, untruncated = run(model, ids, dict(settings, min_p=0.3), settings)
    relative = relative_probs(logits_along(model, ids, kept), kept, 0.2)
    assert min(relative) >= 0.3 - 1e-4
    assert min(relative) < 1.0  # sampled, not greedy
    assert min(relative_probs(logits_along(model, ids, untruncated), untruncated, 0.2)) < 0.3


def test_temperature_sharpens_the_distribution(model):
    ids = prompt(7)
    cold, hot = run(model, ids, dict(temperature=0.05, seed=3), dict(temperature=1.0, seed=3))
    cold_ranks = ranks(logits_along(model, ids, cold), cold)
    hot_ranks = ranks(logits_along(model, ids, hot), hot)
    middle = NUM_TOKENS // 2  # medians: near-greedy when cold, near-uniform over 201k tokens when hot
    assert sorted(cold_ranks)[middle] == 0 and max(cold_ranks) < 50
    assert sorted(hot_ranks)[middle] > 1000


def test_seed_gives_the_same_tokens_in_one_batch(model):
    ids = prompt(8)
    a, b, c = run(
        model, ids, dict(temperature=1.0, seed=42), dict(temperature=1.0, seed=42), dict(temperature=1.0, seed=43)
    )
    assert a == b and a != c
