"""`POST /v1/responses/input_tokens` (`client.responses.input_tokens.count`): the tokens of the
prompt the same create request would run on, tools and instructions included, without running it."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.agent_server.responses.test_routes import WEATHER_TOOL
from tests.conftest import MODEL


@pytest.fixture(params=["fake", "tiny"])
def server(request):
    return request.getfixturevalue({"fake": "fake_server", "tiny": "tiny_engine_server"}[request.param])


def test_the_count_is_the_prompt_a_create_runs_on(server):
    client = server.client()
    first = client.responses.create(model=MODEL, input="Remember: cobalt.", max_output_tokens=4)
    request = dict(
        model=MODEL,
        previous_response_id=first.id,
        instructions="Answer in one word.",
        tools=[WEATHER_TOOL],
        input=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "What was the word?"}],
    )
    calls_before = len(server.engine.calls) if server.kind == "fake" else None
    counted = client.responses.input_tokens.count(**request)
    assert counted.object == "response.input_tokens"
    if server.kind == "fake":
        assert len(server.engine.calls) == calls_before  # nothing was generated
    created = client.responses.create(**request, max_output_tokens=4)
    assert counted.input_tokens == created.usage.input_tokens
    if server.kind == "fake":
        assert counted.input_tokens == len(server.engine.calls[-1].request.prompt_token_ids)
    # Tools and instructions are part of the prompt.
    bare = client.responses.input_tokens.count(model=MODEL, previous_response_id=first.id, input=request["input"])
    assert bare.input_tokens < counted.input_tokens


def test_what_the_count_takes(fake_server):
    client, url = fake_server.client(), f"{fake_server.url}/v1/responses/input_tokens"
    plain = client.responses.input_tokens.count(input="hello").input_tokens  # the model may be left out
    assert (
        plain
        == client.responses.input_tokens.count(
            model=MODEL, input="hello", personality="friendly", truncation="auto", parallel_tool_calls=False
        ).input_tokens
    )
    # A prompt longer than the context is counted, not refused.
    huge = client.responses.input_tokens.count(input="hello " * 9000).input_tokens
    assert huge > fake_server.engine.max_model_len
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="gpt-5", input="hello")
    for body, param in [
        ({"input": "x", "max_output_tokens": 5}, "max_output_tokens"),
        ({"input": "x", "stream": True}, "stream"),
    ]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"] == {
            **r.json()["error"],
            "param": param,
            "code": "unknown_parameter",
        }
    r = httpx.post(url, json={"input": [{"type": "input_image"}]})
    assert r.status_code == 400
