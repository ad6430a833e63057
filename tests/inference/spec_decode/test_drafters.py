"""Speculative decoding in the engine on the tiny model: greedy output with drafts equals greedy
output without them, token for token, whatever the drafter guesses; rejected drafts leave
nothing behind in the KV cache; stop conditions inside kept drafts end the request exactly there.

Drafters: the real n-gram and EAGLE-3 ones, and a scripted "oracle" that proposes the known
greedy continuation (optionally with wrong tokens at chosen offsets), which makes acceptance
lengths exact and predictable.
"""

from __future__ import annotations

import random

import pytest

from inference.config import EngineConfig
from inference.engine.core import LLMEngine
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from inference.request import GenerationRequest, SamplingParams
from inference.runner.single_sequence import generate
from inference.spec_decode.drafter import DraftContext
from tests.engine_runs import drain, tokens_of

WORDS = [11, 22, 33]  # with BIAS the model writes only these, so n-grams recur
BIAS = {w: 30.0 for w in WORDS}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-spec"), seed=0)


@pytest.fixture(scope="module")
def model(checkpoint):
    return GptOssModel.from_pretrained(checkpoint, device="cpu")


def prompt(seed: int, length: int, words=None) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(words) if words else rng.randrange(200_000) for _ in range(length)]


def engine(model, **options) -> LLMEngine:
    options.setdefault("page_size", 4)
    options.setdefault("num_pages", 256)
    return LLMEngine(model, EngineConfig(**options))


def run(eng: LLMEngine, requests: list[GenerationRequest], on_step=None) -> dict[str, list]:
    for r in requests:
        eng.add_request(r)
    return drain(eng, on_step)


def greedy(rid, ids, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(**{"temperature": 0.0, **sampling}))


def assert_all_pages_free(eng: LLMEngine) -> None:
    assert eng.cache.full.num_used == 0 and eng.cache.sliding.num_used == 0
    assert all(r == 0 for r in eng.cache.full.refcount + eng.cache.sliding.refcount)


def assert_pages_match_tokens(eng: LLMEngine) -> None:
    """Every running sequence holds exactly the pages of its computed tokens (rejected drafts'
    pages were given back), and the pools count exactly the pages someone holds or caches."""
    held = set()
    for seq in eng.scheduler.running:
        if not eng.drafter.writes_ahead:
            assert len(seq.pages.full) == eng.cache.num_pages(seq.num_computed)
        held.update(seq.pages.full)
    assert held <= {p for p in range(eng.cache.full.num_pages) if eng.cache.full.refcount[p] > 0}


def requests_set(max_tokens=24):
    plain = [greedy(f"p{i}", prompt(i, n), max_tokens=max_tokens) for i, n in enumerate([5, 13, 22])]
    biased = [
        greedy(f"b{i}", prompt(10 + i, n, WORDS), max_tokens=max_tokens, logit_bias=BIAS)
        for i, n in enumerate([9, 17, 30])
    ]
    return plain + biased


class Oracle:
    """Proposes the known greedy continuation; `wrong` offsets within each draft get a wrong token."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, expected: dict[str, list[int]], wrong: tuple[int, ...] = (), writes_ahead: bool = False):
        self.expected, self.wrong, self.writes_ahead = expected, wrong, writes_ahead
        self.proposed = 0

    def kv_bytes_per_page(self, page_size):
        return 0

    def allocate_kv(self, num_pages, page_size):
        pass

    def propose(self, ctx: DraftContext) -> list[list[int]]:
        out = []
        for seq, limit in zip(ctx.seqs, ctx.limit):
            done = seq.num_output_tokens
            guess = list(self.expected[seq.request_id][done : done + limit])
            for i in self.wrong:
                if i < len(guess):
                    guess[i] = 7  # never what the tiny model writes here
            self.proposed += len(guess)
            out.append(guess)
        return out


def with_oracle(model, expected, k, wrong=(), writes_ahead=False, **options) -> LLMEngine:
    eng = engine(model, speculative="ngram", num_draft_tokens=k, **options)
    eng.drafter = Oracle(expected, wrong, writes_ahead)
    return eng


# -- greedy equality with the real drafters --------------------------------------------------


def test_ngram_greedy_equals_plain_greedy(model):
    plain_engine = engine(model, max_num_batched_tokens=16)  # long prompts prefill in chunks beside decodes
    plain = run(plain_engine, requests_set())
    reqs = requests_set()
    eng = engine(model, max_num_batched_tokens=16, speculative="ngram", num_draft_tokens=4)
    spec = run(eng, reqs, on_step=assert_pages_match_tokens)
    for r in reqs:
        assert tokens_of(spec[r.request_id]) == tokens_of(plain[r.request_id]), r.request_id
        assert spec[r.request_id][-1].finish_reason == "length"
    stats = eng.stats()
    assert stats.spec_steps > 0 and stats.spec_accepted_tokens > 0
    assert stats.tokens_decoded == 6 * 24
    assert stats.steps < plain_engine.steps  # kept drafts save steps
    assert_all_pages_free(eng)


def test_eagle3_greedy_equals_plain_greedy(model, tmp_path):
    from inference.spec_decode.eagle3 import write_random_eagle3_checkpoint

    # A random draft whose small vocabulary holds the biased words, so it sometimes guesses right.
    draft = write_random_eagle3_checkpoint(
        tmp_path / "draft", model.config, draft_vocab_size=3, seed=1, draft_token_ids=WORDS
    )
    reqs = requests_set(20)
    plain = run(engine(model), requests_set(20))
    eng = engine(model, speculative="eagle3", draft_model=str(draft), num_draft_tokens=3)
    spec = run(eng, reqs, on_step=assert_pages_match_tokens)
    for r in reqs:
        assert tokens_of(spec[r.request_id]) == tokens_of(plain[r.request_id]), r.request_id
    stats = eng.stats()
    assert stats.spec_steps > 0 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert_all_pages_free(eng)


def test_eagle3_beside_an_fp8_target_cache(model, tmp_path, monkeypatch):
    """kv_cache_dtype "fp8" with an EAGLE-3 drafter: the target's caches are fp8, the draft
    layer's stay in the model's dtype, the attention warm-up covers both, and the speculative
    greedy output equals plain greedy over the same fp8 cache."""
    from inference.ops.attention.reference import FP8_KV_DTYPE
    from inference.spec_decode.eagle3 import write_random_eagle3_checkpoint

    draft = write_random_eagle3_checkpoint(
        tmp_path / "draft", model.config, draft_vocab_size=3, seed=1, draft_token_ids=WORDS
    )
    warmed = []
    monkeypatch.setattr(model.attention_backend, "warmup", lambda *args: warmed.append(args[-1]), raising=False)
    reqs = requests_set(20)
    plain = run(engine(model, kv_cache_dtype="fp8"), requests_set(20))
    assert warmed == [FP8_KV_DTYPE]
    warmed.clear()
    eng = engine(model, kv_cache_dtype="fp8", speculative="eagle3", draft_model=str(draft), num_draft_tokens=3)
    assert warmed == [FP8_KV_DTYPE, model.dtype]
    assert eng.kv_caches[0][0].dtype == FP8_KV_DTYPE and eng.drafter.kv_cache[0].dtype == model.dtype
    spec = run(eng, reqs, on_step=assert_pages_match_tokens)
    for r in reqs:
        assert tokens_of(spec[r.request_id]) == tokens_of(plain[r.request_id]), r.request_id
    assert eng.stats().spec_accepted_tokens > 0
    assert_all_pages_free(eng)


# -- exact acceptance with a scripted drafter --------------------------------------------------


def test_all_drafts_kept_gives_k_plus_one_tokens_per_step(model):
    ids = prompt(1, 11)
    expected = generate(model, ids, 21)
    eng = with_oracle(model, {"a": expected}, k=4)
    out = run(eng, [greedy("a", ids, max_tokens=21)])["a"]
    assert tokens_of(out) == expected
    # Prefill samples 1 token, then each step keeps 4 drafts and adds one: 1 + 4 * 5 = 21.
    assert [len(d.token_ids) for d in out] == [1, 5, 5, 5, 5]
    stats = eng.stats()
    assert (stats.spec_steps, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (4, 16, 16)
    assert stats.mean_acceptance_length == 5.0
    assert_all_pages_free(eng)
    # /metrics reports the same numbers.
    from agent_server.metrics import Metrics

    text = Metrics(lambda: eng).render().decode()
    assert "oss_agent_spec_decode_mean_acceptance_length 5.0" in text
    assert "oss_agent_spec_decode_accepted_tokens_total 16.0" in text


@pytest.mark.parametrize("writes_ahead", [False, True])
def test_wrong_drafts_are_rolled_back(model, writes_ahead):
    """The third draft of every step is wrong: two are kept, the target corrects the third, and
    the K/V written for the wrong one and after it must not leak into later steps."""
    ids = prompt(2, 9)
    expected = generate(model, ids, 30)
    eng = with_oracle(model, {"a": expected}, k=4, wrong=(2,), writes_ahead=writes_ahead)
    out = run(eng, [greedy("a", ids, max_tokens=30)], on_step=assert_pages_match_tokens)["a"]
    assert tokens_of(out) == expected
    assert all(len(d.token_ids) == 3 for d in out[1:-1])  # 2 kept + the correction
    stats = eng.stats()
    assert stats.spec_accepted_tokens == sum(len(d.token_ids) - 1 for d in out[1:])
    assert_all_pages_free(eng)


def test_rolled_back_pages_never_reach_the_prefix_cache(model):
    """After a run full of rejections, a new request over the same text reuses the cached pages;
    its output is still exact, so only correct K/V was published for sharing."""
    ids = prompt(3, 10)
    expected = generate(model, ids, 26)
    eng = with_oracle(model, {"a": expected, "b": expected[7:]}, k=3, wrong=(1,))
    run(eng, [greedy("a", ids, max_tokens=26)])
    follow = ids + expected[:7]
    out = run(eng, [greedy("b", follow, max_tokens=19)])["b"]
    assert out[0].num_cached_tokens == 16  # four full pages of a's tokens
    assert tokens_of(out) == expected[7:]
    assert_all_pages_free(eng)


def test_stop_token_inside_kept_drafts_ends_the_request_there(model):
    ids = prompt(4, 8)
    expected = generate(model, ids, 20)
    stop = expected[6]
    assert stop not in expected[:6]
    eng = with_oracle(model, {"a": expected}, k=4)
    out = run(eng, [greedy("a", ids, max_tokens=20, stop_token_ids=[stop])])["a"]
    assert tokens_of(out) == expected[:7]  # up to and including the stop token, nothing after it
    assert out[-1].finish_reason == "stop" and out[-1].stop_token_id == stop
    assert_all_pages_free(eng)


def test_drafts_never_run_past_max_tokens_or_the_context(model):
    ids = prompt(5, 6)
    expected = generate(model, ids, 9)
    eng = with_oracle(model, {"a": expected}, k=4, max_model_len=40)
    out = run(eng, [greedy("a", ids, max_tokens=9)])["a"]
    assert tokens_of(out) == expected and out[-1].finish_reason == "length"
    assert eng.drafter.proposed <= 9 - 1  # never more drafts than tokens still wanted, minus the bonus
    # Near the end of the context: the last step may not draft past max_model_len.
    long_ids = prompt(6, 30)
    expected = generate(model, long_ids, 10)
    eng = with_oracle(model, {"b": expected}, k=4, max_model_len=40)
    out = run(eng, [greedy("b", long_ids, max_tokens=10)])["b"]
    assert tokens_of(out) == expected and out[-1].finish_reason == "length"


def test_speculation_under_memory_pressure_and_a_small_sliding_pool(model):
    """Few pages: sequences are preempted and recomputed, the sliding pool frees pages as the
    window moves; drafts must not change any output."""
    reqs = requests_set(16)
    plain = run(engine(model), requests_set(16))
    eng = engine(model, num_pages=24, num_sliding_pages=14, speculative="ngram", num_draft_tokens=3)
    spec = run(eng, reqs)
    for r in reqs:
        assert tokens_of(spec[r.request_id]) == tokens_of(plain[r.request_id]), r.request_id
    assert eng.stats().preemptions > 0 and eng.stats().spec_accepted_tokens > 0
    assert_all_pages_free(eng)


def test_a_parked_sequence_continues_with_speculation(model):
    ids = prompt(7, 9, WORDS)
    eng = engine(model, speculative="ngram", num_draft_tokens=3)
    first = run(
        eng,
        [GenerationRequest("t1", ids, SamplingParams(temperature=0, max_tokens=10, logit_bias=BIAS), keep_alive=True)],
    )
    history = ids + tokens_of(first["t1"])
    follow = history + prompt(8, 5, WORDS)
    second = run(
        eng,
        [
            GenerationRequest(
                "t2", follow, SamplingParams(temperature=0, max_tokens=12, logit_bias=BIAS), continue_from="t1"
            )
        ],
    )
    plain = run(engine(model), [greedy("x", follow, max_tokens=12, logit_bias=BIAS)])
    assert tokens_of(second["t2"]) == tokens_of(plain["x"])
    assert second["t2"][0].num_cached_tokens == len(history) - 1  # all but the last token: its pages


def test_engine_options_are_checked(model, tmp_path):
    with pytest.raises(ValueError, match="speculative must be one of"):
        engine(model, speculative="medusa")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        engine(model, speculative="ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft_model"):
        engine(model, speculative="eagle3")


def test_serve_flags_reach_the_engine(checkpoint, tmp_path):
    import argparse

    from agent_server.cli.serve import add_arguments, engine_options
    from inference.spec_decode.eagle3 import Eagle3Drafter, write_random_eagle3_checkpoint
    from inference.spec_decode.ngram import NgramDrafter

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = engine_options(parser.parse_args(["--speculative", "ngram", "--num-draft-tokens", "3"]))
    assert options == {"speculative": "ngram", "num_draft_tokens": 3}
    eng = LLMEngine.from_pretrained(checkpoint, device="cpu", num_pages=64, **options)
    assert isinstance(eng.drafter, NgramDrafter) and eng.num_draft_tokens == 3
    with pytest.raises(SystemExit, match="--draft-model"):
        engine_options(parser.parse_args(["--speculative", "eagle3"]))
    eng = LLMEngine.from_pretrained(
        checkpoint,
        device="cpu",
        num_pages=64,
        speculative="eagle3",
        draft_model=str(write_random_eagle3_checkpoint(tmp_path, eng.model.config)),
    )
    assert isinstance(eng.drafter, Eagle3Drafter) and eng.num_draft_tokens == 4
    # Its K/V pages are counted in the full pool's page size.
    assert (
        eng.cache_usage().bytes_per_full_page
        > LLMEngine.from_pretrained(checkpoint, device="cpu", num_pages=64).cache_usage().bytes_per_full_page
    )


def test_a_failing_drafter_costs_speed_not_output(model):
    ids = prompt(9, 7)

    class Broken(Oracle):
        def propose(self, ctx):
            raise RuntimeError("drafter fell over")

    eng = engine(model, speculative="ngram", num_draft_tokens=3)
    eng.drafter = Broken({})
    out = run(eng, [greedy("a", ids, max_tokens=8)])["a"]
    assert tokens_of(out) == generate(model, ids, 8) and out[-1].finish_reason == "length"
    assert eng.stats().spec_steps == 0
    assert_all_pages_free(eng)
