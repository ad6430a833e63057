"""Function calling over the Responses API: the model asks, we run the function, it answers.

OSS_AGENT_BASE_URL=http://127.0.0.1:8000/v1 python examples/function_calling.py
"""

import json
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OSS_AGENT_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OSS_AGENT_API_KEY", "none"),
)
served = client.models.list().data[0]
model = os.environ.get("OSS_AGENT_MODEL") or served.id
if getattr(served, "random_weights", False):  # `oss-agent serve` with no --model
    print(
        "note: the server runs a tiny model with random weights, so its text is noise and "
        "it will not call get_weather; serve a real checkpoint with --model to see this example work."
    )

tools = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def get_weather(city: str) -> dict:
    return {"city": city, "temperature_c": 21, "sky": "clear"}  # a stand-in for a real service


response = client.responses.create(model=model, input="What's the weather in Paris?", tools=tools)
for turn in range(5):  # answer the model's calls until it gives a final answer
    calls = [item for item in response.output if item.type == "function_call"]
    if not calls:
        if turn == 0:
            print("(the model answered without calling get_weather)")
        break
    outputs = []
    for call in calls:
        result = get_weather(**json.loads(call.arguments))
        print(f"{call.name}({call.arguments}) -> {result}")
        outputs.append({"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(result)})
    response = client.responses.create(model=model, previous_response_id=response.id, input=outputs, tools=tools)
print(response.output_text)
