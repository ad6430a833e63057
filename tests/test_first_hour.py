"""What a new user meets first, on the server README.md's set-up section starts (no --model: the
tiny random-weight model): the README's Python snippet and the examples run against it and finish
in seconds, its answers are capped and it says its text is noise, and `generate` does the same."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agent_server import default_model
from tests.conftest import make_app, readme_section

ROOT = Path(__file__).resolve().parent.parent
SECONDS = 60  # "in seconds": each run takes one or two on an idle CPU; a loaded 2-core CI machine is slower


def run_python(code_or_path: str | Path, server, *args: str) -> tuple[str, float]:
    env = {**os.environ, "OSS_AGENT_BASE_URL": f"{server.url}/v1"}
    env.pop("OSS_AGENT_MODEL", None)
    command = (
        [sys.executable, str(code_or_path)] if isinstance(code_or_path, Path) else [sys.executable, "-c", code_or_path]
    )
    started = time.monotonic()
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    return done.stdout, elapsed


def test_the_readmes_python_snippet_runs_against_the_default_server(default_server):
    # It asked for gpt-oss-20b and got a 404 (the default server serves gpt-oss-tiny-random);
    # fixed by hand, it then streamed 3,622 tokens of noise for 98 s.
    [snippet] = re.findall(r"```python\n(.*?)```", readme_section("Usage"), re.S)
    assert 'base_url="http://127.0.0.1:8000/v1"' in snippet and 'model="gpt-oss-20b"' in snippet
    out, elapsed = run_python(snippet.replace("http://127.0.0.1:8000", default_server.url), default_server)
    # (it prints the answer's text, which on random weights held to Harmony's structure may be
    # empty: a turn that spends the default 48 tokens on a search; what counts is that it runs)
    assert elapsed < SECONDS


@pytest.mark.parametrize(
    "example, no_show",
    [
        ("function_calling.py", "(the model answered without calling get_weather)"),
        ("web_search_agent.py", "[search]"),  # the example forces the search (tool_choice)
        ("streaming_chat.py", None),
    ],
)
def test_the_examples_finish_in_seconds_on_the_default_model_and_say_why_they_show_little(
    example, no_show, default_server
):
    # function_calling.py ran 3 minutes and web_search_agent.py 2.5 on it, showing nothing.
    # (What they show on a real model: tests/test_server_examples.py, scripted.)
    out, elapsed = run_python(ROOT / "examples" / example, default_server)
    assert elapsed < SECONDS, out
    assert out.startswith("note: the server runs a tiny model with random weights, so its text is noise")
    if no_show is not None:
        assert no_show in out
    if example == "web_search_agent.py":  # the search ran, with a query (the forced call fits the 48 tokens)
        assert re.search(r"^\[search\] .+$", out, re.M), out


def test_the_default_model_caps_output_it_was_not_given_a_limit_for(default_server):
    limit = default_model.MAX_OUTPUT_TOKENS
    card = httpx.get(f"{default_server.url}/v1/models").json()["data"][0]
    assert (card["id"], card["random_weights"], card["default_max_output_tokens"]) == (default_model.NAME, True, limit)
    client = default_server.client()
    response = client.responses.create(model="gpt-oss-20b", input="Tell me a long story.")
    assert response.usage.output_tokens <= limit and response.max_output_tokens == limit
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == limit
    # A request's own limit wins, above the default or below it.
    response = client.responses.create(model="gpt-oss-120b", input="Tell me a long story.", max_output_tokens=70)
    assert response.max_output_tokens == 70 and response.usage.output_tokens <= 70
    chat = client.chat.completions.create(model=default_model.NAME, messages=[{"role": "user", "content": "Hi"}])
    assert chat.usage.completion_tokens <= limit
    chat = client.chat.completions.create(
        model=default_model.NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.usage.completion_tokens <= 3
    # Names it does not answer to are still a 404, as in OpenAI.
    r = httpx.post(f"{default_server.url}/v1/responses", json={"model": "gpt-4o", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_server_with_no_default_limit_leaves_requests_alone(tmp_path):
    # (a real model's server: no cap, and the response echoes what the request set, here nothing)
    from tests.conftest import LiveServer
    from tests.fake_engine import ScriptedEngine

    engine = ScriptedEngine()
    with LiveServer(make_app(lambda: engine, tmp_path / "r.db")) as server:
        response = server.client().responses.create(model="gpt-oss-test", input="Hi")
        assert response.max_output_tokens is None
        assert engine.calls[-1].request.sampling.max_tokens == engine.max_model_len - len(
            engine.calls[-1].request.prompt_token_ids
        )


def test_generate_without_a_model_says_it_is_noise_and_stops_early(tmp_path, monkeypatch, capsys):
    from agent_server.cli.main import main
    from inference.tokenizer import harmony_encoding

    monkeypatch.setenv("OSS_AGENT_CACHE", str(tmp_path))
    assert main(["generate", "--device", "cpu", "Tell me a long story."]) == 0
    out, err = capsys.readouterr()
    assert "random weights" in err and "noise" in err and "hf download openai/gpt-oss-20b" in err
    assert f"at most {default_model.MAX_OUTPUT_TOKENS} tokens" in err
    assert len(harmony_encoding().encode(out.strip(), allowed_special="all")) <= 2 * default_model.MAX_OUTPUT_TOKENS


def test_the_log_says_when_the_server_is_ready(tmp_path, caplog):
    # /health answers 200 from the start (the process is up); /ready once the model is loaded:
    # the log marks that moment.
    from tests.conftest import LiveServer
    from tests.fake_engine import ScriptedEngine

    with caplog.at_level(logging.INFO, logger="agent_server.app"):
        with LiveServer(make_app(ScriptedEngine, tmp_path / "r.db")) as server:
            assert httpx.get(f"{server.url}/ready").status_code == 200
    assert "ready: serving gpt-oss-test (context 8192 tokens); /ready answers 200 from now on" in caplog.text


def test_ci_runs_the_test_command_the_readme_prints():
    # What a user runs from the README is what CI runs, then the slow tests the default run
    # leaves out (the README says how to run them), in two parts: test_moe.py's (started early,
    # in the background) and the others.
    section = readme_section("Set up")
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    [readme_command] = [
        line.split("#")[0].strip() for block in blocks for line in block.splitlines() if "pytest" in line
    ]
    ci = [
        re.sub(r"\s*(>.*)?&?$", "", line.strip())
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if re.match(r"\s*python3 -m pytest", line)
    ]
    moe = "tests/inference/ops/test_moe.py"
    assert ci == [f"{readme_command} -m slow {moe}", readme_command, f"{readme_command} -m slow --ignore={moe}"]
    assert f"`{readme_command} -m slow`" in section
    assert "-m" not in readme_command.split("pytest", 1)[1].split()  # the default: pyproject's addopts
    assert re.search(r"addopts = \"-m 'not slow'\"", (ROOT / "pyproject.toml").read_text())


def test_the_readmes_cpu_torch_is_one_the_package_keeps():
    # A torch outside the package's range would be replaced by the next install: by the CUDA build.
    wanted = re.search(r'^\s*"(torch[<>=!~][^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    [line] = [line for line in readme_section("Set up").splitlines() if "download.pytorch.org/whl/cpu" in line]
    assert f'"{wanted}"' in line
