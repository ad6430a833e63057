"""The OpenAI Agents SDK (Python), unchanged, against the live server: a function-tool loop run
statelessly (store=False + encrypted reasoning), streamed and not; and examples/agents_sdk.py.
"""

from __future__ import annotations

import pytest

from inference.tokenizer import harmony_encoding
from tests.conftest import MODEL
from tests.examples.test_examples import run_example

pytestmark = pytest.mark.slow  # a long end-to-end run: CI runs it with `-m slow`

agents = pytest.importorskip("agents")

THINKING = "The user wants the weather; call get_weather."
CALL = (
    f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
ANSWER = "<|channel|>final<|message|>It is 21°C and clear in Paris.<|return|>"


@pytest.fixture(autouse=True)
def no_tracing():
    agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI's platform otherwise


def agent(server):
    from openai import AsyncOpenAI

    from examples.agents_sdk import build_agent

    return build_agent(AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0), MODEL)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_stateless_function_tool_loop(tool_server, stream):
    engine = tool_server.engine
    engine.say(CALL, ANSWER)
    if stream:
        result = agents.Runner.run_streamed(agent(tool_server), "What's the weather in Paris?")
        kinds = [event.item.type async for event in result.stream_events() if event.type == "run_item_stream_event"]
        assert {"reasoning_item", "tool_call_item", "tool_call_output_item", "message_output_item"} <= set(kinds)
    else:
        result = await agents.Runner.run(agent(tool_server), "What's the weather in Paris?")
    assert result.final_output == "It is 21°C and clear in Paris."
    # The second request carried the conversation itself, the reasoning sealed, and the model
    # saw its own analysis again, then the tool's result.
    first, second = engine.calls[-2:]
    reasoning = next(item for item in result.new_items if item.type == "reasoning_item").raw_item
    assert reasoning.encrypted_content and THINKING not in reasoning.encrypted_content
    prompt = harmony_encoding().decode(second.request.prompt_token_ids)
    assert f"<|channel|>analysis<|message|>{THINKING}<|end|>" in prompt
    assert prompt.endswith(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        "It is 21°C and clear in Paris.<|end|><|start|>assistant"
    )
    assert second.request.prompt_token_ids[: len(first.request.prompt_token_ids)] == first.request.prompt_token_ids
    assert not any(
        record for record in [await tool_server.state.store.get(r.response_id) for r in result.raw_responses]
    )  # store=False: nothing kept


@pytest.mark.parametrize("flag", [[], ["--stream"]], ids=["plain", "streamed"])
def test_the_agents_sdk_example(fake_server, flag):
    fake_server.engine.say(CALL, ANSWER)
    out = run_example(fake_server, "agents_sdk.py", *flag)
    assert out.strip().endswith("It is 21°C and clear in Paris.")
    if flag:
        assert 'calling get_weather({"city": "Paris"})' in out
