"""The OpenAI Agents SDK (`pip install openai-agents`) on oss-agent: an agent with a function
tool, run statelessly as many agent clients run (store=False: nothing is kept on the server;
the model's reasoning travels with the conversation, sealed, as `encrypted_content`).

    OSS_AGENT_BASE_URL=http://127.0.0.1:8000/v1 python examples/agents_sdk.py [--stream]
"""

import argparse
import asyncio
import os

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"It is 21°C and clear in {city}."  # a stand-in for a real service


def build_agent(client: AsyncOpenAI, model: str) -> Agent:
    return Agent(
        name="Assistant",
        instructions="Answer briefly. Use the tools when they help.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(store=False, response_include=["reasoning.encrypted_content"]),
    )


async def main(stream: bool) -> None:
    set_tracing_disabled(True)  # the SDK would send traces to OpenAI's platform otherwise
    client = AsyncOpenAI(
        base_url=os.environ.get("OSS_AGENT_BASE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("OSS_AGENT_API_KEY", "none"),
    )
    model = os.environ.get("OSS_AGENT_MODEL") or (await client.models.list()).data[0].id
    agent = build_agent(client, model)
    question = "What's the weather in Paris?"
    if stream:
        result = Runner.run_streamed(agent, question)
        async for event in result.stream_events():
            if event.type == "run_item_stream_event" and event.item.type == "tool_call_item":
                print(f"calling {event.item.raw_item.name}({event.item.raw_item.arguments})")
    else:
        result = await Runner.run(agent, question)
    print(result.final_output)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="stream the run's events")
    asyncio.run(main(parser.parse_args().stream))
