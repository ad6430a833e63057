"""What the turn grammar guarantees, through the live server on the tiny random model (which
follows nothing on its own): strict json_schema answers validate against their schema, a
required or named tool is called with arguments valid against its schema, and a forced built-in
tool runs mid-generation with its events streamed. The same on the engine in a process of its own
(the grammar crosses the process boundary as plain data). On the scripted engine: what grammar
each request carries."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.conftest import MODEL, LiveServer, build_tiny_engine, make_app

RECORD = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["n", "ok", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
FUNCTIONS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in f.items() if k != "type"}} for f in FUNCTIONS]
INPUTS = ["Give me a record.", "Another one, please.", "JSON only."]


@pytest.fixture(params=["tiny", "tiny-process"])
def tiny_server(request):
    return request.getfixturevalue({"tiny": "tiny_engine_server", "tiny-process": "tiny_process_server"}[request.param])


@pytest.mark.slow
def test_strict_json_schema_answers_validate(tiny_server):
    client = tiny_server.client()
    answers = 0
    for text in INPUTS:
        response = client.responses.create(
            model=MODEL,
            input=text,
            temperature=0,
            max_output_tokens=80,
            text={"format": {"type": "json_schema", "name": "record", "schema": RECORD, "strict": True}},
        )
        if response.status == "completed":
            jsonschema.validate(json.loads(response.output_text), RECORD)
            answers += 1
        else:  # the budget ran out in the reasoning (the grammar leaves the answer room: it should not)
            assert response.incomplete_details.reason == "max_output_tokens"
    assert answers >= 2
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A record."}],
        n=3,
        seed=1,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}},
    )
    stopped = [c for c in completion.choices if c.finish_reason == "stop"]
    for choice in stopped:
        jsonschema.validate(json.loads(choice.message.content), RECORD)
    assert stopped


def test_json_object_answers_are_json_objects(tiny_engine_server):
    completion = tiny_engine_server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Some JSON."}],
        n=4,
        seed=3,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    for choice in completion.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens inside the object: still a JSON object's beginning
            assert choice.message.content.startswith("{")


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_functions_are_called_with_arguments_of_their_schema(tiny_server, choice):
    client = tiny_server.client()
    for text in INPUTS[:2]:
        response = client.responses.create(
            model=MODEL, input=text, tools=FUNCTIONS, tool_choice=choice, max_output_tokens=60
        )
        assert response.status == "completed"
        (call,) = [o for o in response.output if o.type == "function_call"]
        assert [o.type for o in response.output] == ["function_call"]  # the call is the turn
        if choice != "required":
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    chat_choice = choice if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Now."}],
        tools=CHAT_TOOLS,
        tool_choice=chat_choice,
        max_tokens=60,
    )
    (choice0,) = completion.choices
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    (call,) = choice0.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.fixture(scope="module")
def tiny_tool_server(tmp_path_factory, tiny_checkpoint):
    """The real tiny engine with the fake browser and python tools."""
    from tests.fake_tools import FakeBrowser, FakePython

    tools = {"browser": FakeBrowser(), "python": FakePython()}
    engine = build_tiny_engine(tiny_checkpoint)
    app = make_app(lambda: engine, tmp_path_factory.mktemp("tiny-tools") / "responses.sqlite3", tools=tools.values())
    with LiveServer(app, kind="tiny") as server:
        server.tools = tools
        yield server


def stream_events(server, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_a_forced_web_search_runs_mid_generation(tiny_tool_server):
    browser = tiny_tool_server.tools["browser"]
    browser.calls.clear()
    events = stream_events(
        tiny_tool_server,
        {
            "model": MODEL,
            "input": "Search.",
            "max_output_tokens": 200,
            "tools": [{"type": "web_search_preview"}],
            "tool_choice": {"type": "web_search_preview"},
        },
    )
    types = [e["type"] for e in events]
    for kind in (
        "response.web_search_call.in_progress",
        "response.web_search_call.searching",
        "response.web_search_call.completed",
    ):
        assert kind in types
    first = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert first["type"] == "web_search_call" and first["status"] == "completed"
    recipient, arguments = browser.calls[0]
    assert recipient == "browser.search" and first["action"]["query"] == json.loads(arguments)["query"]
    # The model went on after the search (its answer, on a random model, runs to the budget).
    assert types[-1] in ("response.completed", "response.incomplete")
    assert types.index("response.web_search_call.completed") < len(types) - 1


def test_a_forced_python_cell_runs_mid_generation(tiny_tool_server):
    python = tiny_tool_server.tools["python"]
    python.calls.clear()
    events = stream_events(
        tiny_tool_server,
        {
            "model": MODEL,
            "input": "Compute.",
            "max_output_tokens": 60,
            "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}],
            "tool_choice": {"type": "code_interpreter"},
        },
    )
    types = [e["type"] for e in events]
    assert (
        "response.code_interpreter_call_code.delta" in types and "response.code_interpreter_call.interpreting" in types
    )
    first = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert first["type"] == "code_interpreter_call" and first["status"] in ("completed", "failed")
    assert python.calls == [first["code"]]  # the cell ran, with the code streamed (random code fails: that is fine)


def test_requests_carry_the_grammar_of_what_they_ask(fake_server):
    engine, client = fake_server.engine, fake_server.client()
    engine.say('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}<|call|>')
    client.responses.create(
        model=MODEL, input="Hi", tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_time"}
    )
    grammar = engine.calls[-1].request.sampling.grammar
    assert (
        grammar.kind == "lark" and grammar.text.startswith("start: call_0\n") and "functions.get_time" in grammar.text
    )
    assert "functions.get_weather" not in grammar.text  # forced: only the named function
    prompt = engine.calls[-1].request.prompt_token_ids
    from inference.tokenizer import harmony_encoding

    assert "You must" not in harmony_encoding().decode(prompt)  # the grammar forces it, not a sentence
    client.responses.create(model=MODEL, input="Hi", tools=FUNCTIONS)
    grammar = engine.calls[-1].request.sampling.grammar
    assert "functions.get_weather" in grammar.text and "functions.get_time" in grammar.text
    assert 'answer: <|channel|> "final"' in grammar.text  # free to answer


def test_a_strict_schema_the_grammar_cannot_hold_is_a_400(fake_server):
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    r = httpx.post(
        f"{fake_server.url}/v1/responses",
        json={
            "model": MODEL,
            "input": "Hi",
            "text": {"format": {"type": "json_schema", "name": "r", "schema": bad, "strict": True}},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema"
    r = httpx.post(
        f"{fake_server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad, "strict": True}}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"


# Custom tools with a grammar: their input follows it whenever the model calls them. Both grammars
# have finite languages, so the random model always finishes the call; each has a Python regular
# expression for its language, a check independent of llguidance.
CUSTOM_GRAMMARS = {
    "lark": (
        'start: call\ncall: OP "(" NUM ", " NUM ")"\nOP: "add" | "mul"\nNUM: /[0-9]{1,3}/\n',
        r"(add|mul)\([0-9]{1,3}, [0-9]{1,3}\)",
    ),
    "regex": (r"[a-z]{1,8}/[0-9]{2}", r"[a-z]{1,8}/[0-9]{2}"),
}


def custom_tool(syntax: str, name: str = "calc") -> dict:
    definition = CUSTOM_GRAMMARS[syntax][0]
    return {
        "type": "custom",
        "name": name,
        "description": "Compute something.",
        "format": {"type": "grammar", "syntax": syntax, "definition": definition},
    }


def custom_choices(name: str) -> list:
    return [
        {"type": "custom", "name": name},
        "required",
        {"type": "allowed_tools", "mode": "required", "tools": [{"type": "custom", "name": name}]},
    ]


@pytest.mark.parametrize("syntax", ["lark", "regex"])
def test_a_custom_tools_input_follows_its_grammar(tiny_engine_server, syntax):
    client, language = tiny_engine_server.client(), CUSTOM_GRAMMARS[syntax][1]
    other = {"type": "function", "name": "get_time", "parameters": TIME, "strict": True}
    for choice in custom_choices("calc"):
        response = client.responses.create(
            model=MODEL,
            input="Compute.",
            tools=[other, custom_tool(syntax)] if choice != "required" else [custom_tool(syntax)],
            tool_choice=choice,
            max_output_tokens=60,
        )
        assert response.status == "completed", response.incomplete_details
        (call,) = response.output
        assert (call.type, call.name) == ("custom_tool_call", "calc")
        assert re.fullmatch(language, call.input), call.input


@pytest.mark.parametrize("syntax", ["lark", "regex"])
def test_a_streamed_custom_tool_input_follows_its_grammar(tiny_engine_server, syntax):
    events = stream_events(
        tiny_engine_server,
        {
            "model": MODEL,
            "input": "Compute.",
            "tools": [custom_tool(syntax, "tag")],
            "tool_choice": {"type": "custom", "name": "tag"},
            "max_output_tokens": 60,
        },
    )
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"]) for i in done] == [("custom_tool_call", "tag")]
    text = done[0]["input"]
    assert re.fullmatch(CUSTOM_GRAMMARS[syntax][1], text), text
    assert "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta") == text
    (finished,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert finished["input"] == text and events[-1]["type"] == "response.completed"


def test_a_custom_tool_called_unforced_follows_its_grammar(tiny_engine_server):
    """tool_choice "auto": the random model calls the tools now and then (in about a third of
    its turns), and every input it finishes follows the grammar. (A turn that runs out of
    max_output_tokens inside a call ends incomplete, with the input cut where it stopped.)"""
    client, seen = tiny_engine_server.client(), 0
    for i in range(24):
        response = client.responses.create(
            model=MODEL,
            input=f"Compute {i}.",
            tools=[custom_tool("lark"), custom_tool("regex", "tag")],
            max_output_tokens=40,
        )
        if response.status == "incomplete":
            assert response.incomplete_details.reason == "max_output_tokens"
            continue
        assert response.status == "completed"
        for call in [o for o in response.output if o.type == "custom_tool_call"]:
            language = CUSTOM_GRAMMARS["lark" if call.name == "calc" else "regex"][1]
            assert re.fullmatch(language, call.input), call.input
            seen += 1
        if seen:
            break
    assert seen


def test_a_custom_text_tool_is_called_with_any_text(tiny_engine_server):
    """A custom tool with the `text` format (or none) is not held to a grammar: its input is
    one JSON string, unquoted."""
    tool = {"type": "custom", "name": "note", "format": {"type": "text"}}
    response = tiny_engine_server.client().responses.create(
        model=MODEL, input="Note.", tools=[tool], tool_choice={"type": "custom", "name": "note"}, max_output_tokens=60
    )
    assert [(o.type, o.name) for o in response.output] == [("custom_tool_call", "note")]
    assert isinstance(response.output[0].input, str)


def test_a_custom_tools_grammar_holds_in_every_turn_that_offers_it(tmp_path, fake_engine):
    """Not only when forced: a turn free to answer still holds the tool's input to its grammar
    (also with the Harmony structure off, which leaves only what a request asks enforced)."""
    app = make_app(lambda: fake_engine, tmp_path / "responses.sqlite3", harmony_grammar=False)
    with LiveServer(app, kind="fake") as server:
        client = server.client()
        client.responses.create(model=MODEL, input="Hi", tools=[custom_tool("lark"), custom_tool("regex", "tag")])
        grammar = fake_engine.calls[-1].request.sampling.grammar
        assert grammar is not None and 'answer: <|channel|> "final"' in grammar.text  # free to answer
        assert '" to=functions.calc code" <|message|>' in grammar.text and "%lark {" in grammar.text
        assert '" to=functions.tag code" <|message|>' in grammar.text
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "custom", "name": "note"}])
        assert fake_engine.calls[-1].request.sampling.grammar is None  # a text tool: nothing to enforce


@pytest.mark.parametrize(
    "tools, param, words",
    [
        (
            [{**custom_tool("lark"), "format": {**custom_tool("lark")["format"], "definition": 'start: "a" foo'}}],
            "tools[0].format.definition",
            ["lark grammar", "'calc'", "unknown name"],
        ),
        (
            [{**custom_tool("regex"), "format": {**custom_tool("regex")["format"], "definition": "[a-"}}],
            "tools[0].format.definition",
            ["regex grammar", "'calc'", "unclosed character class"],
        ),
        (
            [{**custom_tool("regex"), "format": {**custom_tool("regex")["format"], "definition": "(?<=a)b"}}],
            "tools[0].format.definition",
            ["look-around"],
        ),
        (
            [{**custom_tool("lark"), "format": {**custom_tool("lark")["format"], "definition": ""}}],
            "tools[0].format.definition",
            ["Empty grammar"],
        ),
        (
            [
                {"type": "function", "name": "f", "parameters": {"type": "object"}},
                {
                    "type": "namespace",
                    "name": "space",
                    "description": "Some tools.",
                    "tools": [
                        {**custom_tool("lark"), "format": {**custom_tool("lark")["format"], "definition": "start: ("}}
                    ],
                },
            ],
            "tools[1].tools[0].format.definition",
            ["lark grammar"],
        ),
    ],
)
def test_a_custom_tool_grammar_that_cannot_be_enforced_is_a_400(fake_server, tools, param, words):
    r = httpx.post(f"{fake_server.url}/v1/responses", json={"model": MODEL, "input": "Hi", "tools": tools})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
