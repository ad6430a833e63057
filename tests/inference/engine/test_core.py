"""The synchronous engine on a tiny random model, checked against one-sequence generation.

The oracle is `inference.runner.single_sequence.generate` (the same model, one sequence, contiguous
pages): whatever the engine does with batching, chunking, page sharing, sliding-window freeing
or preemption, greedy outputs must equal it token for token. Tiny model: 2 layers (sliding,
full), sliding window 8; page size 4 so prompts cross many pages and the window.
"""

from __future__ import annotations

import logging

import pytest
import torch

from inference.config import EngineConfig
from inference.engine.core import LLMEngine
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from inference.ops.attention.reference import FP8_KV_DTYPE
from inference.request import GenerationRequest, SamplingParams
from inference.runner.single_sequence import SingleSequenceCache, generate
from tests.engine_runs import drain, tokens_of
from tests.engine_runs import random_prompt as prompt

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-engine"), seed=0)
    return GptOssModel.from_pretrained(path, device="cpu")


def engine(model, **options) -> LLMEngine:
    options.setdefault("page_size", 4)
    options.setdefault("num_pages", 256)
    return LLMEngine(model, EngineConfig(**options))


def request(rid: str, ids: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(**{**GREEDY, **sampling}))


def assert_all_pages_free(eng: LLMEngine) -> None:
    assert eng.cache.full.num_used == 0 and eng.cache.sliding.num_used == 0
    assert all(r == 0 for r in eng.cache.full.refcount + eng.cache.sliding.refcount)


def run_with_late_arrivals(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list]:
    """The first half of the prompts, three steps, then the rest joining a batch already
    decoding; every request's deltas by id ("0", "1", ...)."""
    half = len(prompts) // 2
    for i in range(half):
        eng.add_request(request(str(i), prompts[i], max_tokens=max_tokens))
    out: dict[str, list] = {}
    for _ in range(3):
        for d in eng.step():
            out.setdefault(d.request_id, []).append(d)
    for i in range(half, len(prompts)):
        eng.add_request(request(str(i), prompts[i], max_tokens=max_tokens))
    for rid, ds in drain(eng).items():
        out.setdefault(rid, []).extend(ds)
    return out


def test_concurrent_greedy_equals_each_alone(model):
    prompts = [prompt(i, n) for i, n in enumerate([3, 9, 14, 21, 30, 5])]
    alone = [generate(model, p, 10) for p in prompts]
    eng = engine(model, max_num_batched_tokens=16)  # long prompts prefill in chunks beside decodes
    out = run_with_late_arrivals(eng, prompts, 10)
    for i, expected in enumerate(alone):
        assert tokens_of(out[str(i)]) == expected, i
        assert out[str(i)][-1].finish_reason == "length"
        assert all(d.num_prompt_tokens == len(prompts[i]) for d in out[str(i)])
    stats = eng.stats()
    assert stats.tokens_decoded == 60 and stats.tokens_prefilled == sum(map(len, prompts))
    assert_all_pages_free(eng)


def test_fp8_cache_greedy_equals_each_alone(model):
    """kv_cache_dtype "fp8": the engine's caches are float8 e4m3 and its greedy outputs, batched,
    chunked and joining mid-run, equal one-sequence generation over fp8 caches token for token.
    Their logits differ from the model-dtype cache's (so the test sees fp8), within what 4
    significant bits of K and V give on this random model (2-9% a position, 18% over a prompt)."""
    prompts = [prompt(40 + i, n) for i, n in enumerate([3, 9, 14, 21, 30, 5])]
    alone = [generate(model, p, 10, kv_dtype=FP8_KV_DTYPE) for p in prompts]
    eng = engine(model, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    assert all(k.dtype == v.dtype == FP8_KV_DTYPE for k, v in eng.kv_caches)
    out = run_with_late_arrivals(eng, prompts, 10)
    for i, expected in enumerate(alone):
        assert tokens_of(out[str(i)]) == expected, i
    assert_all_pages_free(eng)

    fp8 = SingleSequenceCache(model, 40, kv_dtype=FP8_KV_DTYPE).forward(prompts[4])
    exact = SingleSequenceCache(model, 40).forward(prompts[4])
    err = float((fp8 - exact).norm() / exact.norm())
    assert 0 < err < 0.3, err


def test_fp8_cache_holds_more_tokens_in_the_same_memory(model):
    """Sized from a memory budget, an fp8 cache gets 4x the pages of this float32 model's; a bad
    dtype is refused."""
    budget = dict(num_pages=None, kv_cache_memory=4 << 20)
    auto, fp8 = engine(model, **budget), engine(model, kv_cache_dtype="fp8", **budget)
    assert auto.kv_caches[0][0].dtype == model.dtype == torch.float32
    assert fp8.cache.sliding.num_pages >= auto.cache.sliding.num_pages
    assert fp8.cache.full.num_pages >= 4 * auto.cache.full.num_pages
    assert fp8.cache.bytes_per_full_page * 4 == auto.cache.bytes_per_full_page
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine(model, kv_cache_dtype="fp16")


def test_sliding_layers_keep_only_the_window(model):
    prompts = [prompt(10 + i, 26) for i in range(3)]
    alone = [generate(model, p, 12) for p in prompts]
    # The sliding pool is far smaller than what three 38-token sequences would hold.
    eng = engine(model, num_pages=64, num_sliding_pages=14)
    for i, p in enumerate(prompts):
        eng.add_request(request(str(i), p, max_tokens=12))
    samples = []
    out = drain(eng, on_step=lambda e: samples.append(e.cache_usage()))
    assert [tokens_of(out[str(i)]) for i in range(3)] == alone
    peak = max(samples, key=lambda u: u.sliding_pages_without_window)
    assert peak.sliding_pages_without_window >= 27  # 3 sequences x 9+ pages
    assert peak.sliding_pages_used <= 3 * 4  # each keeps pages for the last 8 positions (+ the one being filled)
    assert peak.sliding_bytes_saved > 0


def test_shared_prefix_prefills_only_the_new_part(model):
    base = prompt(20, 26)
    follow_up = base + prompt(21, 5)
    same_system = base[:20] + prompt(22, 7)
    expected = {"b": generate(model, follow_up, 6), "c": generate(model, same_system, 6)}
    eng = engine(model)
    eng.add_request(request("a", base, max_tokens=6))
    drain(eng)
    before = eng.stats()
    eng.add_request(request("b", follow_up, max_tokens=6))
    out = drain(eng)
    after = eng.stats()
    # 6 full pages of the 26-token prompt are cached, with the sliding pages their window needs.
    assert out["b"][0].num_cached_tokens == 24
    assert after.tokens_prefilled - before.tokens_prefilled == len(follow_up) - 24
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 24
    assert tokens_of(out["b"]) == expected["b"]
    eng.add_request(request("c", same_system, max_tokens=6))
    out = drain(eng)
    assert out["c"][0].num_cached_tokens == 20
    assert tokens_of(out["c"]) == expected["c"]
    assert_all_pages_free(eng)


def test_prefix_without_its_window_pages_is_recomputed(model):
    base = prompt(30, 26)
    follow_up = base + prompt(31, 5)
    expected = generate(model, follow_up, 6)
    eng = engine(model, num_pages=64, num_sliding_pages=6)
    eng.add_request(request("a", base, max_tokens=6))
    drain(eng)
    # Unrelated work reuses the small sliding pool, evicting a's cached window pages.
    eng.add_request(request("x", prompt(32, 22), max_tokens=2))
    drain(eng)
    eng.add_request(request("b", follow_up, max_tokens=6))
    out = drain(eng)
    assert out["b"][0].num_cached_tokens < 24  # full pages alone are not enough
    assert tokens_of(out["b"]) == expected


def test_tiny_page_budget_preempts_and_completes_everything(model):
    prompts = [prompt(40 + i, 8 + 3 * i) for i in range(8)]
    alone = [generate(model, p, 10) for p in prompts]
    eng = engine(model, num_pages=12, max_num_batched_tokens=32)  # 48 token slots for 8 sequences
    for i, p in enumerate(prompts):
        eng.add_request(request(str(i), p, max_tokens=10))
    out = drain(eng)
    assert eng.stats().preemptions > 0
    for i, expected in enumerate(alone):
        assert tokens_of(out[str(i)]) == expected, i
    assert_all_pages_free(eng)


def test_abort_frees_every_page_at_once(model):
    eng = engine(model)
    for i in range(4):
        eng.add_request(request(str(i), prompt(50 + i, 18), max_tokens=50))
    eng.add_request(request("late", prompt(60, 10), max_tokens=50))
    for _ in range(3):
        eng.step()
    held = {seq.request_id: list(seq.pages.full) for seq in eng.scheduler.running}
    assert set(held) == {"0", "1", "2", "3", "late"}
    delta = eng.abort("1")
    assert delta.finish_reason == "abort" and delta.token_ids == []
    assert all(eng.cache.full.refcount[p] == 0 for p in held["1"])
    assert eng.cache.full.num_used == sum(len(v) for k, v in held.items() if k != "1")
    for rid in ("0", "2", "3", "late"):
        eng.abort(rid)
    assert not eng.has_unfinished()
    assert_all_pages_free(eng)
    assert eng.abort("nope") is None


def test_abort_of_a_waiting_request(model):
    eng = engine(model, max_num_seqs=1)
    eng.add_request(request("a", prompt(70, 6), max_tokens=3))
    eng.add_request(request("b", prompt(71, 6), max_tokens=3))
    eng.step()
    assert eng.stats().waiting == 1
    assert eng.abort("b").finish_reason == "abort"
    out = drain(eng)
    assert "b" not in out and len(tokens_of(out["a"])) == 2  # a's first token came from the first step
    assert_all_pages_free(eng)


def sample_run(model, others: bool, seed: int = 123) -> list[int]:
    eng = engine(model, max_num_batched_tokens=24)
    target = GenerationRequest("x", prompt(80, 12), SamplingParams(temperature=1.0, seed=seed, max_tokens=12))
    if others:
        eng.add_request(GenerationRequest("o1", prompt(81, 20), SamplingParams(temperature=1.0, max_tokens=15)))
        eng.add_request(GenerationRequest("o2", prompt(82, 5), SamplingParams(temperature=0.8, seed=9, max_tokens=15)))
        eng.step()
    eng.add_request(target)
    if others:
        eng.add_request(GenerationRequest("o3", prompt(83, 9), SamplingParams(temperature=0, max_tokens=4)))
    return tokens_of(drain(eng)["x"])


def test_seed_reproduces_whatever_else_runs(model):
    alone = sample_run(model, others=False)
    assert sample_run(model, others=True) == alone
    assert sample_run(model, others=False, seed=124) != alone
    greedy = generate(model, prompt(80, 12), 12)
    assert alone != greedy  # sampling really happened


def test_stop_tokens_and_max_tokens(model):
    ids = prompt(90, 11)
    greedy = generate(model, ids, 12)
    cut = next(i for i in range(3, 12) if greedy[i] not in greedy[:i])
    eng = engine(model)
    eng.add_request(request("stop", ids, max_tokens=12, stop_token_ids=[greedy[cut]]))
    eng.add_request(request("len", ids, max_tokens=3))
    out = drain(eng)
    assert tokens_of(out["stop"]) == greedy[: cut + 1]  # the stop token is the last token
    assert out["stop"][-1].finish_reason == "stop" and out["stop"][-1].stop_token_id == greedy[cut]
    assert tokens_of(out["len"]) == greedy[:3]
    assert out["len"][-1].finish_reason == "length" and out["len"][-1].stop_token_id is None


def test_logit_bias_and_logprobs_reach_the_sampler(model):
    eng = engine(model)
    eng.add_request(request("bias", prompt(100, 7), max_tokens=4, logit_bias={4242: 100.0}))
    eng.add_request(request("lp", prompt(101, 7), max_tokens=3, logprobs=2))
    out = drain(eng)
    assert tokens_of(out["bias"]) == [4242] * 4
    assert all(d.logprobs is None for d in out["bias"])
    for d in out["lp"]:
        (lp,) = d.logprobs
        assert lp.token_id == d.token_ids[0] and len(lp.top) == 2
        assert lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1])  # greedy: best token


def test_continuation_reuses_the_parked_sequence(model):
    first = prompt(110, 13)
    eng = engine(model)
    eng.add_request(GenerationRequest("turn0", first, SamplingParams(temperature=0, max_tokens=6), keep_alive=True))
    generated = tokens_of(drain(eng)["turn0"])
    assert eng.stats().parked == 1 and eng.cache.full.num_used > 0
    tool_output = prompt(111, 5)
    second = first + generated + tool_output
    expected = generate(model, second, 7)
    before = eng.stats()
    eng.add_request(
        GenerationRequest(
            "turn1", second, SamplingParams(temperature=0, max_tokens=7), keep_alive=True, continue_from="turn0"
        )
    )
    out = drain(eng)["turn1"]
    reused = len(first) + len(generated) - 1  # all but the last sampled token, partial page included
    assert out[0].num_cached_tokens == reused
    assert eng.stats().tokens_prefilled - before.tokens_prefilled == len(second) - reused
    assert tokens_of(out) == expected
    assert eng.stats().parked == 1  # turn0 was consumed, turn1 is parked
    eng.release("turn1")
    assert eng.stats().parked == 0
    assert_all_pages_free(eng)


def test_continuation_with_a_different_prompt_falls_back(model):
    first = prompt(120, 13)
    eng = engine(model)
    eng.add_request(GenerationRequest("t0", first, SamplingParams(temperature=0, max_tokens=5), keep_alive=True))
    drain(eng)
    edited = first[:6] + prompt(121, 10)
    expected = generate(model, edited, 5)
    eng.add_request(GenerationRequest("t1", edited, SamplingParams(temperature=0, max_tokens=5), continue_from="t0"))
    out = drain(eng)["t1"]
    # Position 6 would need the sliding pages of positions 0..5, which t0 freed when its window
    # moved on; the prefix cache still has page 0 in both pools.
    assert out[0].num_cached_tokens == 4
    assert tokens_of(out) == expected
    assert eng.stats().parked == 0
    assert_all_pages_free(eng)


def test_bad_requests_are_rejected(model):
    eng = engine(model, max_model_len=40)
    with pytest.raises(ValueError, match="context length"):
        eng.add_request(request("long", prompt(1, 30), max_tokens=11))
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request(request("t", prompt(1, 3), temperature=-1))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(request("e", []))
    with pytest.raises(ValueError, match="prompt token ids"):
        eng.add_request(request("v", [eng.vocab_size]))
    eng.add_request(request("dup", prompt(1, 3), max_tokens=4))
    with pytest.raises(ValueError, match="already running"):
        eng.add_request(request("dup", prompt(2, 3), max_tokens=4))
    assert eng.max_model_len == 40


def test_a_failing_step_fails_only_its_requests(model, monkeypatch):
    eng = engine(model, max_num_seqs=2)
    for rid in ("a", "b", "c"):
        eng.add_request(request(rid, prompt(130 + ord(rid), 7), max_tokens=4))
    real_run, calls = eng.runner.run, []

    def flaky(batch):
        calls.append([s.request_id for s in batch.seqs])
        if len(calls) == 2:
            raise RuntimeError("device fell over")
        return real_run(batch)

    monkeypatch.setattr(eng.runner, "run", flaky)
    out = drain(eng)
    assert calls[1] == ["a", "b"]
    for rid in ("a", "b"):
        assert out[rid][-1].finish_reason == "error" and "device fell over" in out[rid][-1].error
    assert tokens_of(out["c"]) == generate(model, prompt(130 + ord("c"), 7), 4)
    assert_all_pages_free(eng)


def test_default_sizing_on_cpu(model):
    eng = LLMEngine(
        model, EngineConfig(kv_cache_memory=8 << 20, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    )
    usage = eng.cache_usage()
    used = usage.full_pages_total * usage.bytes_per_full_page + usage.sliding_pages_total * usage.bytes_per_sliding_page
    assert used <= 8 << 20
    assert usage.full_pages_total == 4 * 512 // 16  # capped at max_num_seqs full-length sequences
    # What 4 running sequences can need at once (window 8: 1 page + 3 partial, plus a 64-token
    # step's 4 pages), twice over for cached prefixes.
    assert usage.sliding_pages_total == 2 * (4 * 4 + 4)
    k, v = eng.kv_caches[0]
    assert k.shape == (usage.sliding_pages_total, 16, 2, 16) and v.dtype == torch.float32


def test_a_context_past_the_models_positions_is_served_with_a_warning(tmp_path, caplog):
    path = write_tiny_checkpoint(tmp_path, seed=0)  # max_position_embeddings 4096
    longer = GptOssModel.from_pretrained(path, device="cpu", max_positions=5000)
    with caplog.at_level(logging.WARNING, logger="inference.engine.core"):
        eng = engine(longer, max_model_len=5000, num_pages=1300)
    assert eng.max_model_len == 5000 and "beyond the 4096 positions" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inference.engine.core"):
        engine(longer, max_model_len=4096, num_pages=1100)
    assert "beyond" not in caplog.text
