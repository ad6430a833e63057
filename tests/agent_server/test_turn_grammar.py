"""The turn grammar (`agent_server/turn_grammar.py`) against Harmony turns, token by token: what
gpt-oss writes passes whole; a malformed header, an unknown recipient, a call on the wrong channel
or arguments outside their schema are refused at the first token that breaks them."""

from __future__ import annotations

import numpy as np
import pytest

from agent_server.turn_grammar import (
    ANY_OBJECT,
    CallTarget,
    TurnRules,
    check_text_grammar,
    fit_arguments,
    function_arguments,
)
from inference.grammar import Grammar, GrammarCompiler
from inference.tokenizer import CALL, RETURN, harmony_encoding
from tests.fake_engine import harmony_tokens

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
CALLS = [
    CallTarget("functions.get_weather", "commentary", WEATHER),
    CallTarget("browser.search", "analysis", ANY_OBJECT),
    CallTarget("python", "analysis", code=True),
]
CALL_WEATHER = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
SEARCH = '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "gpt-oss"}<|call|>'
PYTHON = "<|channel|>analysis to=python code<|message|>print(6 * 7)<|call|>"
ANSWER = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>"


@pytest.fixture(scope="module")
def compiler():
    c = GrammarCompiler(201088)
    yield c
    c.close()


def accepted(compiler, grammar, text: str) -> int | None:
    """None when the whole turn is accepted (each token allowed by the mask before it), else the
    index of the first refused token."""
    matcher = compiler.compile(grammar, [RETURN, CALL])
    row = np.zeros(matcher.words, dtype=np.int32)
    for i, token in enumerate(harmony_tokens(text)):
        matcher.fill_mask(row)
        if not (row.view(np.uint32)[token // 32] >> (token % 32)) & 1:
            return i
        assert matcher.accept(token)
    return None


@pytest.mark.parametrize(
    "turn",
    [
        ANSWER,
        CALL_WEATHER,
        SEARCH,
        PYTHON,
        "<|channel|>final<|message|>Just the answer.<|return|>",
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant" + CALL_WEATHER,
        '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>',
        CALL_WEATHER.replace("<|call|>", "<|end|><|start|>assistant") + ANSWER,  # parallel calls, then an answer
    ],
)
def test_what_gpt_oss_writes_is_accepted(compiler, turn):
    assert accepted(compiler, TurnRules(CALLS).grammar(), turn) is None


@pytest.mark.parametrize(
    "turn, refused_at",
    [
        ("<|channel|>final<|message|>Hi!<|end|>", "<|end|>"),  # an answer ends the turn
        ("<|message|>Hi<|return|>", "<|message|>"),  # no header
        ("<|channel|>finale<|message|>Hi<|return|>", "e"),
        ("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>", "_time"),
        ("<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{}<|call|>", "functions"),
        (
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": "Paris"}<|call|>',
            "town",
        ),
        ("<|channel|>commentary to=functions.get_weather json<|message|>{}<|call|>", " json"),
        ("<|channel|>final<|message|>Hi<|call|>", "<|call|>"),
    ],
)
def test_malformed_turns_are_refused_where_they_break(compiler, turn, refused_at):
    at = accepted(compiler, TurnRules(CALLS).grammar(), turn)
    assert at is not None
    rest = harmony_encoding().decode(harmony_tokens(turn)[at:])
    assert rest.startswith(refused_at), rest


def test_without_parallel_calls_a_function_call_ends_the_turn(compiler):
    rules = TurnRules(CALLS, parallel_calls=False)
    assert accepted(compiler, rules.grammar(), CALL_WEATHER) is None
    assert accepted(compiler, rules.grammar(), CALL_WEATHER.replace("<|call|>", "<|end|>")) is not None


def test_a_strict_answer_is_json_of_its_schema(compiler):
    rules = TurnRules(CALLS, answer_schema=WEATHER)
    assert accepted(compiler, rules.grammar(), '<|channel|>final<|message|>{"city": "Oslo"}<|return|>') is None
    assert accepted(compiler, rules.grammar(), "<|channel|>final<|message|>Oslo<|return|>") is not None
    assert accepted(compiler, rules.grammar(), CALL_WEATHER) is None  # calls stay possible


def test_a_forced_turn_is_one_call_from_its_first_token(compiler):
    rules = TurnRules(CALLS, forced=[CALLS[0], CALLS[2]])
    forced = rules.grammar(forced=True, budget=200)
    assert accepted(compiler, forced, CALL_WEATHER) is None and accepted(compiler, forced, PYTHON) is None
    for other in (SEARCH, ANSWER, "<|channel|>commentary<|message|>Let me check.<|end|>"):
        assert accepted(compiler, forced, other) is not None
    assert accepted(compiler, rules.grammar(forced=False), ANSWER) is None  # later turns are free again


def test_forced_python_code_ends_within_the_budget(compiler):
    rules = TurnRules(CALLS, forced=[CALLS[2]])
    code = "x = 1\n" * 60
    assert accepted(compiler, rules.grammar(forced=True, budget=400), PYTHON.replace("print(6 * 7)", code)) is None
    assert accepted(compiler, rules.grammar(forced=True, budget=40), PYTHON.replace("print(6 * 7)", code)) is not None


def test_which_function_schemas_hold():
    assert function_arguments(WEATHER, strict=True, forced=False) == WEATHER
    assert function_arguments(WEATHER, strict=None, forced=False) == ANY_OBJECT
    assert function_arguments(WEATHER, strict=None, forced=True) == WEATHER
    assert function_arguments({"type": "strin"}, strict=None, forced=True) == ANY_OBJECT  # cannot hold it
    assert function_arguments(None, strict=True, forced=True) == ANY_OBJECT


@pytest.mark.parametrize(
    "grammar, good, bad",
    [
        (Grammar("lark", 'start: "add(" NUM ", " NUM ")"\nNUM: /[0-9]+/'), "add(1, 22)", "add(1,22)"),
        (Grammar("regex", r"[a-z]+/[0-9]{2}"), "abc/42", "abc/4x"),
    ],
)
def test_a_tool_whose_text_follows_a_grammar(compiler, grammar, good, bad):
    """A custom tool's input with a Lark or regex format (the request schema's `custom` tools
    wire here: a code target with that grammar)."""
    rules = TurnRules(
        [CallTarget("functions.calc", "commentary", code=True, grammar=grammar)],
        forced=[CallTarget("functions.calc", "commentary", code=True, grammar=grammar)],
    )
    call = "<|channel|>commentary to=functions.calc code<|message|>{}<|call|>"
    for g in (rules.grammar(), rules.grammar(forced=True, budget=100)):
        assert accepted(compiler, g, call.format(good)) is None
        assert accepted(compiler, g, call.format(bad)) is not None


def test_a_forced_tools_grammar_text_is_never_cut_short(compiler):
    """Python's free code is bounded by the budget, a grammar's text is not: a limit would let it
    end where its grammar cannot (the response may then run out, never its input off the grammar)."""
    grammar = Grammar("lark", 'start: WORD ("," WORD)*\nWORD: /[a-z]+/')
    target = CallTarget("functions.words", "commentary", code=True, grammar=grammar)
    forced = TurnRules([target], forced=[target]).grammar(forced=True, budget=40)
    assert "max_tokens" not in forced.text
    call = "<|channel|>commentary to=functions.words code<|message|>{}<|call|>"
    assert accepted(compiler, forced, call.format(",".join(["alpha", "beta", "gamma"] * 20))) is None
    assert accepted(compiler, forced, call.format("alpha,")) is not None


@pytest.mark.parametrize(
    "grammar, error",
    [
        (Grammar("lark", 'start: "a" b\nb: "x" -> alias\n# a comment\n%import common.LF\n'), None),
        (Grammar("regex", r"^\d{4}-\d{2}$"), None),
        (Grammar("lark", 'start: "a" foo'), 'unknown name: "foo"'),
        (Grammar("lark", ""), "Empty grammar"),
        (Grammar("regex", "[a-"), "unclosed character class"),
        (Grammar("regex", "(?=a)a"), "look-around"),
    ],
)
def test_which_tool_grammars_can_be_enforced(grammar, error):
    found = check_text_grammar(grammar)
    assert (found is None) if error is None else (error in found), found


def random_turn(compiler, grammar, rng, limit: int) -> list[int]:
    """A turn written by picking any token the grammar allows, uniformly (what a random model
    does, and worse: it favours no token), up to its end or `limit` tokens."""
    matcher = compiler.compile(grammar, [RETURN, CALL])
    row = np.zeros(matcher.words, dtype=np.int32)
    tokens: list[int] = []
    while len(tokens) < limit and not (tokens and tokens[-1] in (RETURN, CALL)):
        assert matcher.fill_mask(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        tokens.append(int(rng.choice(allowed)))
        assert matcher.accept(tokens[-1])
    return tokens


@pytest.mark.parametrize("budget", [48, 120])
def test_a_forced_search_fits_the_turns_budget(compiler, budget):
    """The browser's arguments in a forced turn are cut to fit its budget: the default tiny
    model's 48 tokens still make the search (its query was up to 256 characters, 60 to 100
    tokens of noise, and the response ran out before the search ran)."""
    from agent_server.agent.tool_registry import BROWSER_ARGUMENTS

    search = CallTarget("browser.search", "analysis", BROWSER_ARGUMENTS["search"], fits_budget=True)
    grammar = TurnRules([search], forced=[search]).grammar(forced=True, budget=budget)
    rng = np.random.default_rng(0)
    for _ in range(12):
        tokens = random_turn(compiler, grammar, rng, budget)
        assert tokens[-1] == CALL, harmony_encoding().decode(tokens)
    fitted = fit_arguments(BROWSER_ARGUMENTS["search"], budget)
    assert list(fitted["properties"]) == ["query"] and 1 <= fitted["properties"]["query"]["maxLength"] < 256
    assert fit_arguments(BROWSER_ARGUMENTS["search"], 4000) == BROWSER_ARGUMENTS["search"]  # room for any call
    unfitted = CallTarget("browser.search", "analysis", BROWSER_ARGUMENTS["search"])
    assert TurnRules([unfitted], forced=[unfitted]).grammar(forced=True, budget=budget).text != grammar.text
