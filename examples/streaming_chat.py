"""Stream a Chat Completion, showing the model's reasoning apart from its answer.

OSS_AGENT_BASE_URL=http://127.0.0.1:8000/v1 python examples/streaming_chat.py "Why is the sky blue?"
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
        "note: the server runs a tiny model with random weights, so its text is noise; serve a real checkpoint "
        "with --model for real answers."
    )
prompt = sys.argv[1] if len(sys.argv) > 1 else "Why is the sky blue? One sentence."

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": prompt}],
    reasoning_effort="low",
    # (no limit: the server's own default, a few dozen tokens on its random-weight default model)
    **({"max_tokens": int(os.environ["OSS_AGENT_MAX_TOKENS"])} if os.environ.get("OSS_AGENT_MAX_TOKENS") else {}),
    stream=True,
    stream_options={"include_usage": True},
)
section = None  # "reasoning" or "answer": print a heading when the stream switches
for chunk in stream:
    if chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens]")
    for choice in chunk.choices:
        reasoning = getattr(choice.delta, "reasoning_content", None)
        for kind, text in (("reasoning", reasoning), ("answer", choice.delta.content)):
            if text:
                if section != kind:
                    print(f"\n--- {kind} ---")
                    section = kind
                print(text, end="", flush=True)
