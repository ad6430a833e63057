"""Grammars as the engine compiles them (`inference/grammar.py`): what each mask allows, token by
token, for JSON schemas, regular expressions and Lark grammars naming Harmony's special tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inference.grammar import Grammar, GrammarCompiler, check_grammar
from inference.request import SamplingParams
from inference.tokenizer import CALL, CHANNEL, MESSAGE, RETURN, encode_text

VOCAB = 201088
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler():
    c = GrammarCompiler(VOCAB)
    yield c
    c.close()


def allowed(matcher) -> set[int]:
    row = np.zeros(matcher.words, dtype=np.int32)
    matcher.fill_mask(row)
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]).tolist())


def walk(matcher, tokens: list[int]) -> None:
    """Feed `tokens`, checking that each was allowed by the mask before it."""
    for token in tokens:
        assert token in allowed(matcher), token
        assert matcher.accept(token)


def test_a_json_schema_allows_its_values_and_nothing_else(compiler):
    m = compiler.compile(Grammar.json_schema(SCHEMA), [RETURN])
    assert allowed(m) == set(encode_text('{"')[:1])  # `{"n": ` is forced, in gpt-oss's own tokens
    walk(m, encode_text('{"n": 12'))
    nxt = allowed(m)
    assert encode_text(",")[0] in nxt and encode_text("3")[0] in nxt
    assert encode_text("}")[0] not in nxt and RETURN not in nxt  # "tag" is required
    walk(m, encode_text(', "tag": "b"}'))
    assert allowed(m) == {RETURN}  # complete: only the request's stop tokens (never llguidance's placeholder)
    assert m.finished


def test_the_layout_is_the_one_gpt_oss_writes(compiler):
    m = compiler.compile(Grammar.json_schema(SCHEMA), [])
    assert m.valid_prefix(encode_text('{"n": 1, "tag": "a"}')) == len(encode_text('{"n": 1, "tag": "a"}'))
    m = compiler.compile(Grammar.json_schema(SCHEMA), [])
    assert m.valid_prefix(encode_text('{"n":1')) < len(encode_text('{"n":1'))  # no padding, no other spacing


def test_stop_tokens_are_allowed_where_the_grammar_may_end(compiler):
    m = compiler.compile(Grammar("regex", r"[0-9]+"), [RETURN, CALL])
    assert RETURN not in allowed(m)  # nothing yet: not complete
    walk(m, encode_text("7"))
    assert {RETURN, CALL} <= allowed(m) and encode_text("8")[0] in allowed(m)
    assert not m.finished


def test_harmony_special_tokens_match_only_themselves(compiler):
    lark = 'start: <|channel|> "final" <|message|> /[a-z ]+/ <|return|>'
    m = compiler.compile(Grammar("lark", lark), [RETURN])
    assert allowed(m) == {CHANNEL}  # not "<", nor text spelling "<|channel|>"
    walk(m, [CHANNEL, *encode_text("final"), MESSAGE, *encode_text("hi there")])
    assert RETURN in allowed(m) and MESSAGE not in allowed(m)
    walk(m, [RETURN])
    assert m.finished


def test_draft_masks_are_the_masks_after_each_draft_and_leave_the_matcher_where_it_was(compiler):
    m = compiler.compile(Grammar.json_schema(SCHEMA), [])
    walk(m, encode_text('{"n": '))
    drafts = encode_text('45, "')
    before = allowed(m)
    rows = np.zeros((len(drafts) + 1, m.words), dtype=np.int32)
    m.fill_masks_for_drafts(drafts, rows)
    twin = compiler.compile(Grammar.json_schema(SCHEMA), [])
    walk(twin, encode_text('{"n": '))
    for i, token in enumerate(drafts + [None]):
        expected = np.zeros(m.words, dtype=np.int32)
        twin.fill_mask(expected)
        assert np.array_equal(rows[i], expected), i
        if token is not None:
            twin.accept(token)
    assert allowed(m) == before
    walk(m, encode_text('45, "tag": "a"}'))  # it had not moved


def test_valid_prefix_counts_the_allowed_drafts(compiler):
    m = compiler.compile(Grammar("regex", "ab+c"), [])
    assert m.valid_prefix(encode_text("a") + encode_text("b") + encode_text("x")) == 2
    assert m.valid_prefix([]) == 0


def test_each_grammar_compiles_once_and_requests_do_not_share_a_position(compiler):
    g = Grammar("regex", "x[0-9]{2}")
    a = compiler.compile(g, [])
    b = compiler.compile(g, [])
    assert sum(key == g for key in compiler._compiled) == 1
    walk(a, encode_text("x1"))
    assert encode_text("x")[0] in allowed(b)


@pytest.mark.parametrize(
    "grammar, message",
    [
        (Grammar("regex", "[a-"), "unclosed character class"),
        (Grammar("lark", "start: foo"), "unknown name"),
        (Grammar("json_schema", json.dumps({"type": "strin"})), "Invalid type"),
        (Grammar("json_schema", "{not json"), "not JSON"),
    ],
)
def test_a_bad_grammar_is_a_value_error_that_says_why(grammar, message):
    with pytest.raises(ValueError, match=message):
        check_grammar(grammar)
    with pytest.raises(ValueError, match=message):  # the engine's request check (a 400 at the server)
        SamplingParams(grammar=grammar).validate(VOCAB)


def test_a_grammar_kind_must_be_known():
    with pytest.raises(ValueError, match="grammar kind"):
        Grammar("ebnf", "root ::= 'x'")


def test_an_unknown_special_token_fails_when_compiled(compiler):
    with pytest.raises(ValueError, match="unknown special token"):
        compiler.compile(Grammar("lark", 'start: <|nonesuch|> "x"'), [])


def test_a_draft_its_row_refuses_leaves_the_rows_after_it_free(compiler):
    m = compiler.compile(Grammar.json_schema(SCHEMA), [])
    walk(m, encode_text('{"n": 1, "tag'))
    drafts = encode_text('"') + encode_text(":")  # `":` spelled in two tokens, not as gpt-oss writes it
    assert m.valid_prefix(drafts) == 2  # the cheap check lets it through,
    rows = np.zeros((3, m.words), dtype=np.int32)
    m.fill_masks_for_drafts(drafts, rows)
    bits = np.unpackbits(rows[0].view(np.uint8), bitorder="little")
    assert not bits[drafts[0]]  # its row does not: verification rejects it, and never reads the rows after
    assert (rows[1:] == -1).all()
    walk(m, encode_text('": "a"}'))  # the matcher had not moved
