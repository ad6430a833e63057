"""Constrained requests in the engine on the tiny random model (which follows nothing on its own):
every output spells its grammar, the unconstrained requests beside them get exactly the tokens
they get without them, and so with async scheduling (a step launched ahead samples its
constrained rows once their grammar has taken the previous token) and with speculative decoding
(drafts the grammar refuses are never verified)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from inference.config import EngineConfig
from inference.engine.core import LLMEngine
from inference.grammar import Grammar
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from inference.request import GenerationRequest, SamplingParams
from inference.spec_decode.drafter import DraftContext
from inference.tokenizer import RETURN, encode_text, harmony_encoding
from tests.engine_runs import drain, random_prompt, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 12},
    },
    "required": ["n", "ok", "color", "name"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@(example|test)\.(org|com)"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-constrained"), seed=0)
    return GptOssModel.from_pretrained(path, device="cpu")


def engine(model, **options) -> LLMEngine:
    options = {"page_size": 4, "num_pages": 256, **options}
    return LLMEngine(model, EngineConfig(**options))


def request(rid: str, prompt_seed: int, grammar: Grammar | None = None, **sampling) -> GenerationRequest:
    sampling = {"temperature": 0.0, "max_tokens": 40, **sampling}
    prompt = random_prompt(prompt_seed, 6 + prompt_seed % 5)
    return GenerationRequest(rid, prompt, SamplingParams(grammar=grammar, **sampling))


def text(deltas) -> str:
    return harmony_encoding().decode(tokens_of(deltas))  # (free text of a random model need not be UTF-8)


def unconstrained() -> list[GenerationRequest]:
    return [request(f"u{i}", i, max_tokens=24) for i in range(3)]


def constrained(**sampling) -> list[GenerationRequest]:
    return [
        request("json", 10, Grammar.json_schema(SCHEMA), **sampling),
        request("email", 11, Grammar("regex", EMAIL), **sampling),
    ]


def check_constrained(out: dict[str, list]) -> None:
    jsonschema.validate(json.loads(text(out["json"])), SCHEMA)
    assert re.fullmatch(EMAIL, text(out["email"])), text(out["email"])
    for rid in ("json", "email"):  # complete, with no stop token the grammar could allow: it ends there
        assert out[rid][-1].finish_reason == "stop" and out[rid][-1].stop_token_id is None


def run(eng: LLMEngine, requests: list[GenerationRequest]) -> dict[str, list]:
    for r in requests:
        eng.add_request(r)
    return drain(eng)


def test_a_batch_mixing_constrained_and_free_rows_changes_only_the_constrained_ones(model):
    alone = run(engine(model), unconstrained())
    mixed = run(engine(model), unconstrained() + constrained())
    for i in range(3):
        assert tokens_of(mixed[f"u{i}"]) == tokens_of(alone[f"u{i}"])
    check_constrained(mixed)
    # Without its grammar the same request writes no JSON: the mask did it.
    free = run(engine(model), [request("json", 10)])
    with pytest.raises(ValueError):
        json.loads(text(free["json"]))


def test_sampled_constrained_outputs_follow_their_grammar(model):
    for seed in range(3):
        check_constrained(run(engine(model), constrained(temperature=1.0, top_p=0.95, seed=seed)))


def test_stop_tokens_end_a_grammar_where_it_may_end(model):
    # Digits, then the model may stop (the stop token is allowed once the grammar accepts).
    out = run(
        engine(model), [request("d", 3, Grammar("regex", "[0-9]{1,30}"), stop_token_ids=[RETURN], max_tokens=40)]
    )["d"]
    tokens = tokens_of(out)
    if out[-1].finish_reason == "stop" and out[-1].stop_token_id == RETURN:
        tokens = tokens[:-1]
    assert re.fullmatch("[0-9]{1,30}", harmony_encoding().decode(tokens))


def test_lark_grammars_name_harmony_tokens(model):
    lark = 'start: <|channel|> ("analysis" | "final") <|message|> WORD " " WORD <|return|>\nWORD: /[a-z]{1,8}/'
    out = run(engine(model), [request("h", 4, Grammar("lark", lark), stop_token_ids=[RETURN])])["h"]
    assert out[-1].stop_token_id == RETURN
    assert re.fullmatch(r"<\|channel\|>(analysis|final)<\|message\|>[a-z]{1,8} [a-z]{1,8}<\|return\|>", text(out))


def test_a_grammar_that_fails_to_compile_ends_its_request_with_an_error(model):
    eng = engine(model)
    out = run(eng, [request("bad", 1, Grammar("lark", 'start: <|nonesuch|> "x"')), request("u", 2)])
    assert out["bad"][-1].finish_reason == "error" and "unknown special token" in out["bad"][-1].error
    assert out["u"][-1].finish_reason == "length"


def test_a_request_aborted_while_its_grammar_compiles_ends_at_once(model):
    eng = engine(model)
    eng.add_request(request("c", 1, Grammar("regex", "[a-z]+")))
    assert eng.stats().waiting == 1 and eng.has_unfinished()
    delta = eng.abort("c")
    assert delta.finish_reason == "abort" and not eng.has_unfinished()
    assert not any(d.request_id == "c" for d in drain(eng).get("c", []))


def test_async_scheduling_gives_the_same_tokens_and_still_launches_ahead(model):
    sync = run(engine(model, async_scheduling=False), unconstrained() + constrained())
    eng = engine(model, async_scheduling=True)
    deferred = []
    sample_pending = eng.runner.sample_pending
    eng.runner.sample_pending = lambda step: (deferred.append(step.pending is not None), sample_pending(step))
    for r in unconstrained() + constrained():
        eng.add_request(r)
    out, in_flight = {}, 0
    while eng.has_unfinished():
        for d in eng.step():
            out.setdefault(d.request_id, []).append(d)
        in_flight += eng.in_flight
    assert {rid: tokens_of(ds) for rid, ds in out.items()} == {rid: tokens_of(ds) for rid, ds in sync.items()}
    check_constrained(out)
    assert any(deferred)  # constrained rows were launched ahead and sampled once their mask was known
    assert in_flight > 10  # the batch kept overlapping


class Drafter:
    """Proposes `token` `k` times for every sequence; counts what it proposed."""

    aux_layers: tuple[int, ...] = ()
    writes_ahead = False

    def __init__(self, token: int, k: int = 3):
        self.token, self.k, self.proposed = token, k, 0

    def kv_bytes_per_page(self, page_size):
        return 0

    def allocate_kv(self, num_pages, page_size):
        pass

    def propose(self, ctx: DraftContext) -> list[list[int]]:
        out = [[self.token] * min(self.k, limit) for limit in ctx.limit]
        self.proposed += sum(map(len, out))
        return out


@pytest.mark.parametrize("draft", ["7", "!"])
def test_only_drafts_the_grammar_allows_are_verified(model, draft):
    grammar = Grammar("regex", "[0-9]{12}")
    plain = run(engine(model), [request("d", 5, grammar)])
    eng = engine(model, speculative="ngram", num_draft_tokens=3)
    eng.drafter = Drafter(encode_text(draft)[0])
    out = run(eng, [request("d", 5, grammar)])
    assert tokens_of(out["d"]) == tokens_of(plain["d"]) and re.fullmatch("[0-9]{12}", text(out["d"]))
    stats = eng.stats()
    if draft == "!":  # refused by the grammar: cut before verification
        assert eng.drafter.proposed > 0 and stats.spec_draft_tokens == 0
    else:
        assert stats.spec_draft_tokens > 0


def test_ngram_drafts_of_a_forced_text_are_kept(model):
    phrase = "alpha beta gamma delta "
    grammar = Grammar("regex", re.escape(phrase * 3))
    prompt = encode_text(phrase * 2)
    plain = run(
        engine(model), [GenerationRequest("r", prompt, SamplingParams(temperature=0, max_tokens=60, grammar=grammar))]
    )
    eng = engine(model, speculative="ngram", num_draft_tokens=4)
    out = run(eng, [GenerationRequest("r", prompt, SamplingParams(temperature=0, max_tokens=60, grammar=grammar))])
    assert text(out["r"]) == phrase * 3 == text(plain["r"])
    stats = eng.stats()
    assert stats.spec_accepted_tokens > 0 and stats.steps < len(tokens_of(out["r"]))
