"""The example scripts, each run as a client of a live (scripted) server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import MODEL

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(server, name: str, *args: str) -> str:
    env = {**os.environ, "OSS_AGENT_BASE_URL": f"{server.url}/v1", "OSS_AGENT_MODEL": MODEL}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_web_search_agent(fake_server):
    fake_server.engine.say(
        '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "gpt-oss"}<|call|>',
        "<|channel|>final<|message|>It is an open-weight model 【0†L1-L3】.<|return|>",
    )
    out = run_example(fake_server, "web_search_agent.py", "What is gpt-oss?")
    grammar = fake_server.engine.calls[0].request.sampling.grammar
    assert grammar.text.startswith("start: call_0\n") and "to=browser.search" in grammar.text  # the search is forced
    assert "[search] gpt-oss" in out
    assert "It is an open-weight model [gpt-oss release notes]." in out
    assert "cited: gpt-oss release notes <https://example.org/oss>" in out


def test_streaming_chat(fake_server):
    fake_server.engine.say(
        "<|channel|>analysis<|message|>Rayleigh.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Scattering of sunlight.<|return|>"
    )
    out = run_example(fake_server, "streaming_chat.py", "Why is the sky blue?")
    assert "Rayleigh." in out and "Scattering of sunlight." in out and "tokens]" in out


def test_function_calling(fake_server):
    fake_server.engine.say(
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "<|channel|>final<|message|>It is 21°C and clear in Paris.<|return|>",
    )
    out = run_example(fake_server, "function_calling.py")
    assert 'get_weather({"city": "Paris"})' in out and "It is 21°C and clear in Paris." in out
    from inference.tokenizer import harmony_encoding

    prompt = harmony_encoding().decode(fake_server.engine.calls[-1].request.prompt_token_ids)
    assert '"temperature_c": 21' in prompt  # the function's result went back to the model
