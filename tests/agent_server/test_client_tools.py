"""The tool and item types clients send: namespace, custom, local_shell, tool_search and
deferred tools, additional_tools items, allowed_tools / custom tool choices, every web_search
alias with its options, and the request settings Harmony has no field for (verbosity,
reasoning.context, configuration_update). `tool_server` runs on the scripted engine and on
the real tiny one, teacher-forced through the same script.
"""

from __future__ import annotations

import json

import httpx
import pytest

from inference.tokenizer import harmony_encoding
from tests.conftest import MODEL
from tests.fake_engine import harmony_tokens

NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent",
    "description": "Tools for sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]},
        },
        {"type": "custom", "name": "note", "description": "Leave a note."},
    ],
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch to files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}
SHELL = {"type": "local_shell"}
DONE = "<|channel|>final<|message|>Done.<|return|>"


def prompt_text(engine, index: int = -1) -> str:
    return harmony_encoding().decode(engine.calls[index].request.prompt_token_ids)


def forced_recipients(engine) -> list[str]:
    """The recipients the grammar of the last request forces its first turn to call."""
    grammar = engine.calls[-1].request.sampling.grammar
    if grammar is None or not grammar.text.startswith("start: call_"):
        return []
    return sorted(line.split(" to=")[1].split(" ")[0] for line in grammar.text.splitlines() if line.startswith("call_"))


def post(server, body, status=200):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_a_namespace_is_a_harmony_namespace_of_its_own(tool_server):
    engine = tool_server.engine
    engine.say(
        '<|channel|>commentary to=multi_agent.close_agent <|constrain|>json<|message|>{"target": "a1"}<|call|>',
        DONE,
        DONE,
    )
    first = post(tool_server, {"input": "Close a1.", "tools": [NAMESPACE]})
    text = prompt_text(engine)
    assert "## multi_agent\n\n// Tools for sub-agents.\nnamespace multi_agent {" in text
    assert "type close_agent = (_: {\ntarget: string,\n}) => any;" in text and "type note = (_: string) => any;" in text
    call = first["output"][-1]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "close_agent", "multi_agent")
    assert json.loads(call["arguments"]) == {"target": "a1"}
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}
    post(tool_server, {"previous_response_id": first["id"], "tools": [NAMESPACE], "input": [output]})
    chained = engine.calls[-1].request.prompt_token_ids
    assert prompt_text(engine).endswith(
        "<|start|>multi_agent.close_agent to=assistant<|channel|>commentary<|message|>closed<|end|><|start|>assistant"
    )
    # The same turn replayed by a client that keeps the conversation itself.
    post(
        tool_server,
        {"tools": [NAMESPACE], "store": False, "input": [{"role": "user", "content": "Close a1."}, call, output]},
    )
    assert engine.calls[-1].request.prompt_token_ids == chained


def test_custom_tools_take_freeform_text(tool_server):
    engine = tool_server.engine
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    engine.say(f"<|channel|>commentary to=functions.apply_patch code<|message|>{patch}<|call|>", DONE)
    with tool_server.client().responses.stream(model=MODEL, input="Add a.txt", tools=[PATCH]) as stream:
        events = list(stream)
        first = stream.get_final_response()
    text = prompt_text(engine)
    assert "type apply_patch = (_: string) => any;" in text
    assert "The input must match this lark grammar:\n// start:" in text  # shown (the grammar holds it too)
    call = first.output[-1]
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", patch)
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    assert deltas == patch and [e.type for e in events].count("response.custom_tool_call_input.done") == 1
    tool_server.client().responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[PATCH],
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "applied"}],
    )
    assert prompt_text(engine).endswith(
        "<|start|>functions.apply_patch to=assistant<|channel|>commentary<|message|>applied<|end|><|start|>assistant"
    )


def test_a_custom_input_quoted_as_a_json_string_is_unquoted(fake_server):
    fake_server.engine.say(
        '<|channel|>commentary to=functions.apply_patch <|constrain|>json<|message|>"line one\\nline two"<|call|>'
    )
    call = post(fake_server, {"input": "x", "tools": [PATCH]})["output"][-1]
    assert call["input"] == "line one\nline two"


def test_local_shell_calls_and_their_outputs(tool_server):
    engine = tool_server.engine
    engine.say(
        "<|channel|>commentary to=functions.local_shell <|constrain|>json<|message|>"
        '{"command": ["ls", "-la"], "workdir": "/tmp", "timeout_ms": 5000}<|call|>',
        DONE,
        DONE,
    )
    first = post(tool_server, {"input": "List /tmp", "tools": [SHELL]})
    assert "type local_shell = (_: {" in prompt_text(engine)
    call = first["output"][-1]
    assert call["type"] == "local_shell_call" and call["status"] == "completed"
    assert call["action"] == {
        "type": "exec",
        "command": ["ls", "-la"],
        "env": {},
        "timeout_ms": 5000,
        "working_directory": "/tmp",
        "user": None,
    }
    output = {"type": "local_shell_call_output", "id": call["call_id"], "output": "a.txt"}
    post(tool_server, {"previous_response_id": first["id"], "tools": [SHELL], "input": [output]})
    chained = engine.calls[-1].request.prompt_token_ids
    assert prompt_text(engine).endswith(
        "<|start|>functions.local_shell to=assistant<|channel|>commentary<|message|>a.txt<|end|><|start|>assistant"
    )
    post(
        tool_server,
        {"tools": [SHELL], "store": False, "input": [{"role": "user", "content": "List /tmp"}, call, output]},
    )
    assert engine.calls[-1].request.prompt_token_ids == chained


def test_a_shell_command_given_as_one_string_runs_through_bash(fake_server):
    fake_server.engine.say(
        '<|channel|>commentary to=functions.local_shell <|constrain|>json<|message|>{"command": "ls | wc -l"}<|call|>'
    )
    call = post(fake_server, {"input": "x", "tools": [SHELL]})["output"][-1]
    assert call["action"]["command"] == ["bash", "-lc", "ls | wc -l"]


def test_allowed_tools_and_custom_choices(fake_server):
    engine = fake_server.engine
    weather = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
    post(
        fake_server,
        {
            "input": "x",
            "tools": [weather, PATCH],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "custom", "name": "apply_patch"}],
            },
        },
    )
    text = prompt_text(engine)
    assert "apply_patch" in text and "type weather" not in text and "You must" not in text
    assert forced_recipients(engine) == ["functions.apply_patch"]  # the allowed tools only, through the grammar
    post(
        fake_server, {"input": "x", "tools": [weather, PATCH], "tool_choice": {"type": "custom", "name": "apply_patch"}}
    )
    assert forced_recipients(engine) == ["functions.apply_patch"] and "You must" not in prompt_text(engine)
    post(
        fake_server,
        {
            "input": "x",
            "tools": [weather, PATCH],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "custom", "name": "apply_patch"}],
            },
        },
    )
    assert forced_recipients(engine) == []  # "auto" mode forces nothing
    error = post(
        fake_server,
        {
            "input": "x",
            "tools": [weather],
            "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]},
        },
        400,
    )["error"]
    assert error["param"] == "tool_choice.tools[0]"


def test_additional_tools_tool_search_and_deferred_tools(fake_server):
    engine = fake_server.engine
    deferred = {"type": "function", "name": "rare_tool", "defer_loading": True, "parameters": {"type": "object"}}
    extra = {"type": "function", "name": "late_tool", "parameters": {"type": "object"}}
    body = post(
        fake_server,
        {
            "tools": [{"type": "tool_search"}, deferred],
            "input": [
                {"role": "user", "content": "x"},
                {"type": "additional_tools", "role": "developer", "tools": [extra]},
            ],
        },
    )
    text = prompt_text(engine)
    # gpt-oss is shown every tool up front: the deferred one too, and no search tool.
    assert "type rare_tool" in text and "type late_tool" in text and "tool_search" not in text
    assert [t["type"] for t in body["tools"]] == ["tool_search", "function"]
    post(
        fake_server,
        {
            "input": [
                {"role": "user", "content": "x"},
                {
                    "type": "tool_search_call",
                    "call_id": "ts_1",
                    "arguments": {"query": "weather"},
                    "execution": "client",
                },
                {"type": "tool_search_output", "call_id": "ts_1", "execution": "client", "tools": [NAMESPACE]},
            ]
        },
    )
    assert "namespace multi_agent {" in prompt_text(engine)


@pytest.mark.parametrize(
    "kind", ["web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11"]
)
def test_every_web_search_alias_with_its_options(fake_server, kind):
    tool = {
        "type": kind,
        "user_location": {"type": "approximate", "city": "Oslo", "country": "NO", "timezone": "Europe/Oslo"},
        "search_context_size": "low",
    }
    if not kind.startswith("web_search_preview"):
        tool |= {"external_web_access": False, "filters": {"allowed_domains": ["example.org"]}}
    else:
        tool |= {"search_content_types": ["text"]}
    body = post(fake_server, {"input": "x", "tools": [tool]})
    text = prompt_text(fake_server.engine)
    assert "namespace browser {" in text and "The user is in Oslo, NO (time zone Europe/Oslo)" in text
    if not kind.startswith("web_search_preview"):
        assert "these domains only: example.org." in text
    assert body["tools"][0]["type"] == kind


def test_no_live_web_asked_of_a_browser_that_searches_the_web(fake_server, fake_tools):
    fake_tools["browser"].live_web = True
    error = post(fake_server, {"input": "x", "tools": [{"type": "web_search", "external_web_access": False}]}, 400)[
        "error"
    ]
    assert error["param"] == "tools[0].external_web_access" and error["code"] == "unsupported_value"
    post(fake_server, {"input": "x", "tools": [{"type": "web_search", "external_web_access": True}]})


def test_settings_harmony_has_no_field_for(fake_server):
    engine = fake_server.engine
    earlier = [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Old thought."}]},
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": "b"},
    ]
    post(fake_server, {"input": earlier, "text": {"verbosity": "high"}})
    text = prompt_text(engine)
    assert "Old thought." not in text and "Give a thorough, detailed final answer." in text
    post(fake_server, {"input": earlier, "reasoning": {"context": "all_turns", "effort": "xhigh"}})
    text = prompt_text(engine)
    assert "Old thought." in text and "Reasoning: high" in text
    post(
        fake_server,
        {
            "input": [
                *earlier,
                {
                    "type": "configuration_update",
                    "reasoning": {"effort": "minimal"},
                    "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
                },
            ]
        },
    )
    text = prompt_text(engine)
    assert "Reasoning: low" in text and "## out" in text


def test_accepted_settings_are_echoed(fake_server):
    body = post(
        fake_server,
        {
            "input": "x",
            "prompt_cache_key": "k",
            "prompt_cache_retention": "in_memory",
            "context_management": [{"type": "compaction", "compact_threshold": 1000}],
            "reasoning": {"summary": "detailed", "effort": "none"},
            "client_metadata": {"x-codex-turn-metadata": "{}"},
        },
    )
    assert body["reasoning"] == {"effort": "none", "summary": "detailed"}
    assert body["prompt_cache_key"] == "k" and body["prompt_cache_retention"] == "in_memory"
    assert "Reasoning: low" in prompt_text(fake_server.engine)


def test_a_namespace_may_not_take_a_reserved_name(fake_server):
    bad = {**NAMESPACE, "name": "functions"}
    assert post(fake_server, {"input": "x", "tools": [bad]}, 400)["error"]["param"] == "tools[0].name"
    assert len(harmony_tokens(DONE)) > 0


def test_the_turn_grammar_addresses_every_client_tool(fake_server):
    """Client tools are the grammar's recipients: a function with its arguments, a custom tool
    with one JSON string (its input; text of its grammar where it has one), local_shell, and a
    namespace's tools under their namespace."""
    engine = fake_server.engine
    weather = {
        "type": "function",
        "name": "weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    post(fake_server, {"input": "x", "tools": [weather, PATCH, SHELL, NAMESPACE], "tool_choice": "required"})
    assert forced_recipients(engine) == [
        "functions.apply_patch",
        "functions.local_shell",
        "functions.weather",
        "multi_agent.close_agent",
        "multi_agent.note",
    ]
    lines = engine.calls[-1].request.sampling.grammar.text.splitlines()
    bodies = {
        line.split(" to=")[1].split(" ")[0]: line.split("<|message|> ")[1].split(" ")[0]
        for line in lines
        if line.startswith("call_")
    }
    body_of = {line.split(":")[0]: line for line in lines if line.startswith("body_")}
    assert body_of[bodies["functions.apply_patch"]].endswith("%lark {")  # its own grammar
    assert '"type": "string"' in body_of[bodies["multi_agent.note"]]
    assert '"city"' in body_of[bodies["functions.weather"]]
    assert '"command"' in body_of[bodies["functions.local_shell"]]


def test_a_strict_schema_that_cannot_be_enforced_is_refused_in_a_namespace_too(fake_server):
    broken = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
    space = {**NAMESPACE, "tools": [{**NAMESPACE["tools"][0], "strict": True, "parameters": broken}]}
    error = post(fake_server, {"input": "x", "tools": [space]}, 400)["error"]
    assert error["code"] == "invalid_function_parameters" and error["param"] == "tools[0].tools[0].parameters"
    post(fake_server, {"input": "x", "tools": [{**space, "tools": [{**space["tools"][0], "strict": False}]}]})
