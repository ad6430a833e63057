"""Every parameter the installed `openai` SDK can send is handled: accepted, or refused with a
400 that names it and says why (`unsupported_value` / `unsupported_parameter`), never taken
for an unknown parameter or an invalid value.

The cases come from the SDK's own TypedDicts (`tests/sdk_params.py`), so a new SDK release
that adds a field, a tool, an item type or a literal value fails here until the schemas in
`schemas/` handle it.
"""

from __future__ import annotations

import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming

from agent_server.chat import routes as chat_api
from agent_server.errors import APIError
from agent_server.request_parsing import validate_body
from agent_server.responses import routes as responses_api
from schemas.chat import ChatCompletionRequest
from schemas.responses import ResponseCreateRequest
from tests.sdk_params import field_cases

REFUSED = ("unsupported_value", "unsupported_parameter")

RESPONSES_CASES = list(
    field_cases(ResponseCreateParamsNonStreaming, {"model": "m", "input": "hi"}, skip={"model", "stream"})
)
CHAT_CASES = list(
    field_cases(
        CompletionCreateParamsNonStreaming,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        skip={"model", "stream"},
    )
)


def _outcome(schema, unsupported, body) -> APIError | None:
    try:
        validate_body(body, schema, unsupported=unsupported)
    except APIError as e:
        return e
    return None


def _check(cases, schema, unsupported) -> None:
    wrong = []
    for case in cases:
        error = _outcome(schema, unsupported, case.body)
        if error is None:
            continue
        named = error.param is not None and (
            case.path == error.param or case.path.startswith((f"{error.param}.", f"{error.param}["))
        )
        if error.code not in REFUSED or not named or "not supported" not in error.message:
            wrong.append(f"{case}: {error.code}: {error.message} (param {error.param})")
    assert not wrong, f"{len(wrong)} of {len(cases)} SDK fields not handled:\n" + "\n".join(wrong)


def test_the_walk_reaches_the_sdk_surface():
    """The cases cover what the SDK declares (a walk that found nothing would pass anything)."""
    owners = {c.owner for c in RESPONSES_CASES}
    assert len(owners) > 100 and len(RESPONSES_CASES) > 1000
    for name in (
        "function_tool_param.FunctionToolParam",
        "namespace_tool_param.NamespaceToolParam",
        "custom_tool_param.CustomToolParam",
        "web_search_tool_param.WebSearchToolParam",
        "response_reasoning_item_param.ResponseReasoningItemParam",
        "reasoning.Reasoning",
        "tool_choice_allowed_param.ToolChoiceAllowedParam",
    ):
        assert name in owners
    assert any(c.path == "tools[0].external_web_access" and c.value is True for c in RESPONSES_CASES)
    assert len({c.owner for c in CHAT_CASES}) > 40


def test_every_responses_field_of_the_sdk_is_handled():
    _check(RESPONSES_CASES, ResponseCreateRequest, responses_api.UNSUPPORTED)


def test_every_chat_field_of_the_sdk_is_handled():
    _check(CHAT_CASES, ChatCompletionRequest, chat_api.UNSUPPORTED)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}],
                    }
                ]
            },
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
            "input[0].content[0]",
        ),
        (
            {
                "tools": [
                    {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}
                ]
            },
            "tools[0]",
        ),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0]"),
    ],
)
def test_what_gpt_oss_cannot_read_is_refused_by_name(body, param):
    error = _outcome(ResponseCreateRequest, responses_api.UNSUPPORTED, {"model": "m", **body})
    assert error is not None and error.status == 400 and error.code == "unsupported_value"
    assert error.param == param and "not supported" in error.message


def test_unknown_fields_are_still_refused():
    """Strict as OpenAI: a made-up parameter is an unknown parameter, at any depth."""
    for body, param in [
        ({"model": "m", "input": "hi", "temprature": 1}, "temprature"),
        ({"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "colour": 1}]}, "tools[0].colour"),
        ({"model": "m", "input": "hi", "reasoning": {"effort": "low", "depth": 2}}, "reasoning.depth"),
    ]:
        error = _outcome(ResponseCreateRequest, responses_api.UNSUPPORTED, body)
        assert error is not None and error.code == "unknown_parameter" and error.param == param


def test_client_metadata_is_accepted():
    """Codex sends `client_metadata`, which OpenAI accepts though the SDK does not declare it."""
    body = {"model": "m", "input": "hi", "client_metadata": {"x-codex-turn-metadata": "{}"}}
    assert _outcome(ResponseCreateRequest, responses_api.UNSUPPORTED, body) is None
