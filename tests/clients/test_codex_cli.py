"""The Codex CLI, unchanged, against the live server through examples/codex/config.toml: a turn
in which the model calls Codex's shell tool (Codex runs the command and sends its output back,
the reasoning sealed, store=false), then a follow-up turn that replays the whole conversation.

Codex comes from npm, pinned, installed by .ci/run into build/codex (or $OSS_AGENT_CODEX names
the binary). Without it the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from inference.tokenizer import harmony_encoding
from tests.conftest import MODEL

pytestmark = pytest.mark.slow  # a long end-to-end run: CI runs it with `-m slow`

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "codex" / "config.toml"
MARKER = "codex-ran-this-7f3a"
CALL = (
    "<|channel|>analysis<|message|>I will run the command.<|end|><|start|>assistant<|channel|>commentary "
    f'to=functions.exec_command <|constrain|>json<|message|>{{"cmd": "echo {MARKER}"}}<|call|>'
)
ANSWER = f"<|channel|>final<|message|>The command printed {MARKER}.<|return|>"
FOLLOW_UP = "<|channel|>final<|message|>Nothing else to run.<|return|>"


def codex_binary() -> str:
    found = (
        os.environ.get("OSS_AGENT_CODEX")
        or next((str(p) for p in [ROOT / "build" / "codex" / "node_modules" / ".bin" / "codex"] if p.exists()), None)
        or shutil.which("codex")
    )
    if found is None:
        message = "the Codex CLI is not installed (.ci/run installs it into build/codex)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def codex_home(tmp_path: Path, server_url: str) -> Path:
    """$CODEX_HOME with the example config, pointed at the test server and its model name."""
    home = tmp_path / "codex-home"
    home.mkdir()
    config = EXAMPLE.read_text()
    config = re.sub(r'^base_url = ".*"$', f'base_url = "{server_url}/v1"', config, flags=re.M)
    config = re.sub(r'^model = ".*?"', f'model = "{MODEL}"', config, flags=re.M)
    assert f"{server_url}/v1" in config and f'model = "{MODEL}"' in config
    (home / "config.toml").write_text(config)
    return home


def codex(binary: str, home: Path, workdir: Path, *args: str) -> tuple[str, str]:
    """(the final answer Codex prints on stdout, its log of the turn on stderr)"""
    env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(home), "OSS_AGENT_API_KEY": "unused", "NO_COLOR": "1"}
    done = subprocess.run(
        [binary, "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", *args],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip(), done.stderr


def test_codex_runs_a_shell_call_and_a_follow_up_turn(fake_server, tmp_path):
    binary = codex_binary()
    engine = fake_server.engine
    home, workdir = codex_home(tmp_path, fake_server.url), tmp_path / "work"
    workdir.mkdir()
    engine.say(CALL, ANSWER)
    answer, log = codex(binary, home, workdir, "Run the echo command.")
    assert answer == f"The command printed {MARKER}."
    assert f"echo {MARKER}" in log and "succeeded" in log  # Codex ran the command itself
    decode = harmony_encoding().decode
    after_call = decode(engine.calls[1].request.prompt_token_ids)
    # Codex ran the command and sent its output back; the model saw its own reasoning again.
    assert "<|channel|>analysis<|message|>I will run the command.<|end|>" in after_call
    assert re.search(
        rf"<\|start\|>functions\.exec_command to=assistant<\|channel\|>commentary<\|message\|>"
        rf"[^<]*{MARKER}",
        after_call,
    )
    assert "namespace multi_agent_v1 {" in after_call  # Codex's own tool namespace

    engine.say(FOLLOW_UP)
    answer, _ = codex(binary, home, workdir, "resume", "--last", "Anything else?")
    assert answer == "Nothing else to run."
    replayed = decode(engine.calls[2].request.prompt_token_ids)
    assert f"The command printed {MARKER}.<|end|><|start|>user<|message|>Anything else?<|end|>" in replayed
    assert len(engine.calls) == 3


def test_codex_over_a_websocket(fake_server, tmp_path, monkeypatch):
    """Codex's WebSocket mode (`supports_websockets` on its provider): a prewarm (generate=false),
    the turn, and its continuation after the shell call by previous_response_id on the same
    connection, store=false throughout."""
    from agent_server.responses.websocket import ResponsesSocket

    binary = codex_binary()
    engine = fake_server.engine
    home, workdir = codex_home(tmp_path, fake_server.url), tmp_path / "work"
    workdir.mkdir()
    config = home / "config.toml"
    config.write_text(
        config.read_text().replace('wire_api = "responses"', 'wire_api = "responses"\nsupports_websockets = true')
    )
    created = []
    original = ResponsesSocket.create

    async def create(self, body, stream_id):
        created.append({key: body.get(key) for key in ("generate", "previous_response_id", "store")})
        return await original(self, body, stream_id)

    monkeypatch.setattr(ResponsesSocket, "create", create)
    engine.say(CALL, ANSWER)
    answer, log = codex(binary, home, workdir, "Run the echo command.")
    assert answer == f"The command printed {MARKER}."
    assert f"echo {MARKER}" in log and "succeeded" in log
    assert [c["generate"] for c in created] == [False, None, None] and all(c["store"] is False for c in created)
    assert created[2]["previous_response_id"] and len(engine.calls) == 2
    after_call = harmony_encoding().decode(engine.calls[1].request.prompt_token_ids)
    assert "<|channel|>analysis<|message|>I will run the command.<|end|>" in after_call and MARKER in after_call
