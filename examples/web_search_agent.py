"""Ask a question the model answers by searching the web (the server runs the browser tool).

oss-agent serve --model gpt-oss-20b --tool-server browser     # in another terminal
OSS_AGENT_BASE_URL=http://127.0.0.1:8000/v1 python examples/web_search_agent.py "What is gpt-oss?"
"""

import os
import sys

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OSS_AGENT_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OSS_AGENT_API_KEY", "none"),
)
served = client.models.list().data[0]
model = os.environ.get("OSS_AGENT_MODEL") or served.id
if getattr(served, "random_weights", False):  # `oss-agent serve` with no --model
    print(
        "note: the server runs a tiny model with random weights, so its text is noise (tool_choice "
        "still makes it search: for a real query and answer, serve a real checkpoint with --model)."
    )
question = sys.argv[1] if len(sys.argv) > 1 else "What is gpt-oss? Cite your sources."

response = client.responses.create(
    model=model,
    input=question,
    tools=[{"type": "web_search_preview"}],
    tool_choice={"type": "web_search_preview"},  # search first, whatever the model (the default tiny one too)
    include=["web_search_call.action.sources"],
)
searches = [item for item in response.output if item.type == "web_search_call"]
for item in searches:
    print(f"[{item.action.type}] {getattr(item.action, 'query', None) or getattr(item.action, 'url', '')}")
if not searches:
    print("(the model answered without browsing)")
print(response.output_text)
for item in response.output:
    if item.type == "message":
        for part in item.content:
            for citation in part.annotations:
                print(f"  cited: {citation.title} <{citation.url}>")
