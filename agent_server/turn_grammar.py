"""The grammar of one assistant turn, written as Lark for the engine (`inference/grammar.py`).

Every turn the server generates is held to Harmony's structure, so no model, trained or not, can
hand the parser a malformed header:

    <|channel|>analysis<|message|>TEXT<|end|>                               reasoning
    <|channel|>commentary<|message|>TEXT<|end|>                             a preamble
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>     a function call
    <|channel|>analysis to=browser.search <|constrain|>json<|message|>ARGS<|call|>      a built-in call
    <|channel|>analysis to=python code<|message|>CODE<|call|>                python
    <|channel|>final<|message|>ANSWER<|return|>                             the answer

with `<|start|>assistant` between messages. Recipients are only those the request enables;
arguments are JSON (of the tool's schema where it is strict, or forced, or the server's own
tool; any JSON object otherwise) in gpt-oss's layout (`inference.grammar.JSON_LAYOUT`). Built-in
and MCP calls may be on either channel, function calls on commentary; a function call may end in
`<|end|>` and be followed by more messages when parallel calls are allowed.

The answer is JSON of the response format's schema where a strict `json_schema` or `json_object`
format asks for it. Reasoning before such an answer is held to at most half of the turn's budget,
so the answer always has room (a reasoning model given a tight `max_output_tokens` answers rather
than ending incomplete), and no preamble comes before it (its text would join the answer's).

A forced tool (`tool_choice` "required", a named function, a built-in tool, an MCP server or
tool) makes the turn one call, to one of the forced recipients, written from its first token in
its canonical header (functions on commentary, built-ins on analysis). Python's code is free
text: in a forced turn it is bounded to fit the turn's token budget, so the call is always made;
the browser's arguments likewise (under a tight budget, its query is cut short: the default tiny
model's 48 tokens still search).

A custom tool with a grammar (lark or regex) is called like python, in a " code" message, its text
held to that grammar in every turn that offers it, forced or not (and never cut short: a grammar
whose sentences may run longer than the budget can leave the response incomplete, never its input
outside the grammar):

    <|channel|>commentary to=functions.NAME code<|message|>TEXT<|call|>
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from inference.grammar import JSON_LAYOUT, Grammar, grammar_error

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Tokens a forced python call's header and end take, kept out of its code's budget.
CALL_FRAME_TOKENS = 16
# Reasoning messages a turn may hold before a constrained answer.
MAX_NOTES = 2
# The most tokens one character of a JSON string can take: a control character's \u001f escape
# (the grammar writes no other \u escapes; a raw character is at most 4 byte tokens).
TOKENS_PER_CHAR = 6
# Tokens a property's key, quotes and separators take in the JSON layout (`{"query": "...", `).
PROPERTY_FRAME_TOKENS = 8
SCALAR_TOKENS = 8  # an integer's or a boolean's value, at most


@dataclass(frozen=True)
class CallTarget:
    """A recipient the model may address in this turn, and what its message holds."""

    recipient: str  # "functions.get_weather", "browser.search", "python", "<namespace>.<tool>"
    channel: str = "commentary"  # of its header when the call is forced
    arguments: dict[str, Any] | None = None  # JSON Schema of its arguments; None: any JSON object
    code: bool = False  # free text in a " code" message (python), not JSON
    # With `code`: the grammar ("lark" or "regex") the text must follow, as a custom tool's
    # `format` gives it; None: any text.
    grammar: Grammar | None = None
    # The server's own arguments (the browser's): in a forced turn they are cut to fit its token
    # budget (`fit_arguments`), so the call is always made.
    fits_budget: bool = False


@dataclass
class TurnRules:
    """What a request allows its turns to say."""

    calls: list[CallTarget] = field(default_factory=list)
    forced: list[CallTarget] = field(default_factory=list)  # the first turn must call one of these
    answer_schema: dict[str, Any] | None = None  # the final answer's JSON Schema, when constrained
    parallel_calls: bool = True

    def grammar(self, *, forced: bool = False, budget: int | None = None) -> Grammar:
        """The turn's grammar; `forced`: this turn must be one of the forced calls; `budget`: the
        tokens it may generate (a forced python cell and the messages before a constrained answer
        are bounded by it)."""
        return Grammar("lark", turn_lark(self, forced=forced and bool(self.forced), budget=budget))


def function_arguments(schema: dict[str, Any] | None, *, strict: bool | None, forced: bool) -> dict[str, Any]:
    """The arguments a function call is held to: its schema where it is strict (it must then
    compile: `check_strict_schema`) or forced (where it compiles), any JSON object otherwise."""
    if schema is None or not (strict or forced):
        return ANY_OBJECT
    if strict or grammar_error(Grammar.json_schema(schema)) is None:
        return schema
    return ANY_OBJECT


def check_strict_schema(schema: dict[str, Any]) -> str | None:
    """Why a strict schema cannot be enforced (its grammar does not compile), or None."""
    error = grammar_error(Grammar.json_schema(schema))
    return error.strip() if error else None


def check_text_grammar(grammar: Grammar) -> str | None:
    """Why a tool's text grammar (a custom tool's lark or regex `format`) cannot be enforced: it
    does not compile on its own, or not inside a turn; None if it can."""
    error = grammar_error(grammar)
    if error is None:
        error = grammar_error(Grammar("lark", f"start: {_text_body(grammar)}\n"))
    return error.strip() if error else None


def fit_arguments(schema: dict[str, Any], budget: int) -> dict[str, Any]:
    """`schema` (an object of strings, integers and booleans, as the browser's arguments are) made
    to fit `budget` tokens with the call's header: unchanged where its longest arguments fit, else
    only its required properties, each string cut to a share of the room (a character counted at
    its most tokens, `TOKENS_PER_CHAR`)."""
    properties = schema.get("properties", {})

    def most_tokens(p: dict[str, Any]) -> int:
        if p.get("type") == "string":
            return PROPERTY_FRAME_TOKENS + TOKENS_PER_CHAR * p.get("maxLength", budget)
        if p.get("type") in ("integer", "boolean"):
            return PROPERTY_FRAME_TOKENS + SCALAR_TOKENS
        return budget  # (not one the browser has: counted as never fitting)

    if CALL_FRAME_TOKENS + sum(most_tokens(p) for p in properties.values()) <= budget:
        return schema
    required = [k for k in schema.get("required", []) if k in properties]
    kept = {k: properties[k] for k in required}
    strings = [k for k, p in kept.items() if p.get("type") == "string"]
    room = budget - CALL_FRAME_TOKENS - sum(most_tokens(p) for k, p in kept.items() if k not in strings)
    for k in strings:
        share = (room - PROPERTY_FRAME_TOKENS * len(strings)) // (TOKENS_PER_CHAR * len(strings))
        p = kept[k]
        kept[k] = {**p, "maxLength": max(p.get("minLength", 0), min(p.get("maxLength", share), share))}
    return {**schema, "properties": kept, "required": required, "additionalProperties": False}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _text_body(grammar: Grammar | None) -> str:
    """A free-text body: any text, or the text a Lark grammar or a regular expression accepts."""
    if grammar is None:
        return "TEXT"
    if grammar.kind == "lark":
        return "%lark {\n" + grammar.text + "\n}"
    if grammar.kind == "regex":
        from llguidance import regex_to_lark

        return f"/{regex_to_lark(grammar.text)}/"
    raise ValueError(f"a tool's text follows a lark or regex grammar, not {grammar.kind}")


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def turn_lark(rules: TurnRules, *, forced: bool = False, budget: int | None = None) -> str:
    lines: list[str] = []
    calls = []
    targets = rules.forced if forced else rules.calls
    for i, target in enumerate(targets):
        if forced:
            channels = _literal(target.channel)
        elif target.recipient.startswith("functions."):
            channels = '"commentary"'
        else:
            channels = '("analysis" | "commentary")'
        if target.code:
            header = f"{channels} {_literal(' to=' + target.recipient + ' code')} <|message|>"
            # (a grammar's text is not cut short: a limit would let it end where its grammar cannot)
            code_budget = (
                budget - CALL_FRAME_TOKENS if forced and budget is not None and target.grammar is None else None
            )
            limit = f"[max_tokens={code_budget}]" if code_budget is not None and code_budget > 0 else ""
            lines.append(f"body_{i}{limit}: {_text_body(target.grammar)}")
        else:
            header = f'{channels} {_literal(" to=" + target.recipient + " ")} <|constrain|> "json" <|message|>'
            arguments = target.arguments or ANY_OBJECT
            if forced and budget is not None and target.fits_budget:
                arguments = fit_arguments(arguments, budget)
            lines.append(f"body_{i}: {_json(arguments)}")
        end = "<|call|>"
        if rules.parallel_calls and target.recipient.startswith("functions.") and not forced:
            end = '(<|call|> | <|end|> <|start|> "assistant" turn)'  # more calls (or messages) may follow
        lines.append(f"call_{i}: <|channel|> {header} body_{i} {end}")
        calls.append(f"call_{i}")
    if forced:
        head = ["start: " + " | ".join(calls)]
    else:
        notes, note_text, channels = "*", "TEXT", '("analysis" | "commentary")'
        if rules.answer_schema is not None:
            channels = '"analysis"'  # a preamble's text would join the answer's (output_text, content)
            if budget is not None:
                # The answer always has room: before it at most MAX_NOTES messages, together at
                # most half the budget.
                notes, note_text = f" ~ 0..{MAX_NOTES}", "note_text"
                lines.append(f"note_text[max_tokens={max(budget // (2 * MAX_NOTES), 1)}]: TEXT")
        head = [
            "start: turn",
            f'turn: (note <|end|> <|start|> "assistant"){notes} last',
            f"note: <|channel|> {channels} <|message|> {note_text}",
            "last: " + " | ".join(["answer", *calls]),
            'answer: <|channel|> "final" <|message|> answer_body <|return|>',
            "answer_body: " + (_json(rules.answer_schema) if rules.answer_schema is not None else "TEXT"),
        ]
    return "\n".join(head + lines + ["TEXT: /(?s:.+)/", ""])
