"""Comparing two engines' greedy generations: what the GPU tests (GPU vs reference path, 2 GPUs vs
1, speculative vs plain) share.

Two correct implementations that round differently may pick either of two tokens whose logits
differ by less than their rounding error, and after such a step the texts differ. So greedy
outputs are compared token for token up to each sequence's first near tie in the reference
(its top-2 logit margin below `near_tie`), and the test asserts that enough was compared.
"""

from __future__ import annotations

import random

import torch

from tests.engine_runs import drain, tokens_of


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts of `length`, `length + 7`, ... tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(200_000) for _ in range(length + 7 * i)] for i in range(count)]


def greedy(engine, prompt_list, max_tokens):
    """Run all prompts concurrently; per prompt (tokens, their logprobs, top-2 margins)."""
    from inference.request import GenerationRequest, SamplingParams

    for i, p in enumerate(prompt_list):
        engine.add_request(
            GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2))
        )
    return generations(drain(engine), len(prompt_list))


def generations(deltas: dict[str, list], count: int):
    """Requests "0" to count - 1 (asked with logprobs=2) from their deltas: per request (tokens,
    their logprobs, top-2 margins)."""
    result = []
    for i in range(count):
        logprobs = [lp for d in deltas[str(i)] for lp in d.logprobs or []]
        result.append(
            (
                tokens_of(deltas[str(i)]),
                [lp.logprob for lp in logprobs],
                [lp.top[0][1] - lp.top[1][1] for lp in logprobs],
            )
        )
    return result


def compare_greedy(reference, ours, near_tie: float) -> tuple[int, int]:
    """Assert equal tokens up to each sequence's first reference near tie; (compared, total)."""
    compared = total = 0
    for i, ((ref_tokens, _, ref_margins), (tokens, _, _)) in enumerate(zip(reference, ours)):
        total += len(ref_tokens)
        for step, (a, b, m) in enumerate(zip(tokens, ref_tokens, ref_margins)):
            if m < near_tie:
                break
            assert a == b, f"sequence {i} step {step}: chose {a}, the reference {b} (its margin {m:.3f})"
            compared += 1
    return compared, total


def choice_gaps(score, prompt_list, generated) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced scoring of generated tokens. `score(tokens) -> logits [len, V]` of the
    reference for a fresh sequence. Returns, per generated token, (reference best logit - its
    logit, |its logprob here - the reference's|)."""
    choice, logprob = [], []
    for prompt, (tokens, logprobs, _) in zip(prompt_list, generated):
        logits = score(prompt + tokens[:-1])[len(prompt) - 1 :].float().cpu()  # rows predicting `tokens`
        rows, chosen = torch.arange(len(tokens)), torch.tensor(tokens)
        choice.append(logits.max(-1).values - logits[rows, chosen])
        logprob.append((torch.log_softmax(logits, -1)[rows, chosen] - torch.tensor(logprobs)).abs())
    return torch.cat(choice), torch.cat(logprob)


def model_scorer(model):
    """`score` for `choice_gaps` from a model run on its own single-sequence cache."""
    from inference.runner.single_sequence import SingleSequenceCache

    return lambda tokens: SingleSequenceCache(model, len(tokens)).forward(tokens)


def decisive_routing(model, seed: int = 0) -> None:
    """For a model loaded from a checkpoint: what `GptOssModel.from_random(decisive_routing=True)`
    builds in (see `random_tensor_source`). Assigned, not added, so every backend's copy of the
    bias (float32 or bf16) holds exactly the same numbers."""
    g = torch.Generator().manual_seed(seed)
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        for block in model.layers:
            bias = block.mlp.prepared.router_bias
            bias[torch.randperm(bias.numel(), generator=g)[:k].to(bias.device)] = 16.0
