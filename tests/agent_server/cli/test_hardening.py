"""`oss-agent serve` hardening flags reach the app and uvicorn (`serve_captured`: no server
starts and no model loads, the engine is only built in the app's startup)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from agent_server.cli.main import build_parser
from agent_server.request_ids import RequestIdFilter
from tests.conftest import serve_captured


def test_hardening_flags(tiny_checkpoint, tmp_path):
    served = serve_captured(
        [
            "--model",
            str(tiny_checkpoint),
            "--api-key",
            "k1",
            "--cors-origin",
            "https://a.example",
            "--cors-origin",
            "https://b.example",
            "--max-request-bytes",
            "1000",
            "--max-input-items",
            "7",
            "--shutdown-timeout",
            "4.5",
            "--store",
            str(tmp_path / "r.db"),
        ]
    )
    config = served["app"].state.server.config
    assert config.api_key == "k1"
    assert config.cors_origins == ["https://a.example", "https://b.example"]
    assert (config.max_request_bytes, config.max_input_items, config.shutdown_timeout) == (1000, 7, 4.5)
    # uvicorn gives open connections the same deadline, and our access log (with request ids)
    # replaces its own.
    assert served["timeout_graceful_shutdown"] == 4.5 and served["access_log"] is False
    assert any(isinstance(f, RequestIdFilter) for f in served["log_filters"])


def test_defaults_are_safe(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("OSS_AGENT_API_KEY", raising=False)
    served = serve_captured(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db")])
    config = served["app"].state.server.config
    assert config.api_key is None and config.cors_origins == []  # CORS off unless configured
    assert config.max_request_bytes > 0 and config.max_input_items > 0 and config.shutdown_timeout > 0


def test_api_key_from_the_environment(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("OSS_AGENT_API_KEY", "from-env")
    served = serve_captured(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db")])
    assert served["app"].state.server.config.api_key == "from-env"


def test_listening_beyond_loopback_without_a_key_warns(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("OSS_AGENT_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING, logger="oss_agent"):
        serve_captured(["--model", str(tiny_checkpoint), "--host", "0.0.0.0", "--store", str(tmp_path / "r.db")])
    assert any("without --api-key" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "70000"],
        ["serve", "--port", "-1"],
        ["serve", "--log-level", "verbose"],
        ["generate", "hi", "--max-tokens", "0"],
        ["generate", "hi", "--temperature", "-1"],
    ],
)
def test_bad_flags_are_argument_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2 and argv[-2] in capsys.readouterr().err


def test_a_model_folder_without_a_config_is_refused_at_once(tmp_path, caplog, monkeypatch):
    import uvicorn

    from agent_server.cli.serve import run

    monkeypatch.setattr(uvicorn, "Server", None)  # refused before a server is made
    with caplog.at_level(logging.ERROR, logger="oss_agent"):
        assert run(build_parser().parse_args(["serve", "--model", str(tmp_path)])) == 2
    assert "no config.json" in caplog.text


def test_a_model_path_that_does_not_exist_is_named_so(tmp_path, caplog, monkeypatch, capsys):
    # (it was "not a Hugging Face checkpoint folder (no config.json there)", which sends one
    # looking inside a folder that is not there)
    import uvicorn

    from agent_server.cli.main import main

    monkeypatch.setattr(uvicorn, "Server", None)
    with caplog.at_level(logging.ERROR, logger="oss_agent"):
        assert main(["serve", "--model", str(tmp_path / "nowhere")]) == 2
    assert f"--model {tmp_path / 'nowhere'} does not exist" in caplog.text
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "hi"]) == 2
    assert f"--model {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["generate", "--model", str(tmp_path / "file"), "hi"]) == 2
    assert "is a file, not a checkpoint folder" in capsys.readouterr().err


def test_a_server_whose_model_fails_to_load_exits_non_zero(tmp_path, caplog):
    # A real uvicorn run (port 0): the load fails, the process does not stay up serving 503s.
    import json

    from agent_server.cli.serve import run

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    args = build_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--port", "0", "--store", str(tmp_path / "r.db"), "--log-level", "warning"]
    )
    root = logging.getLogger()
    before = {h: list(h.filters) for h in root.handlers}
    try:
        with caplog.at_level(logging.ERROR):
            assert run(args) == 1
    finally:
        for handler, filters in before.items():
            handler.filters[:] = filters
    assert "model_type" in caplog.text


def test_python_cells_stop_before_the_tool_timeout():
    # The sandbox interrupts a cell (its session kept) before the server cancels the call (which
    # ends the session), and the tool's description tells the model that limit.
    from agent_server.cli.serve import python_limits

    assert python_limits(300.0).wall_seconds == 60.0  # the sandbox's own limit
    short = python_limits(10.0)
    assert short.wall_seconds + short.interrupt_grace_seconds < 10.0
    assert python_limits(0.5).wall_seconds == 1.0


def test_python_timeout_sets_the_cell_limit_within_the_tool_timeout():
    from agent_server.cli.serve import python_limits

    long = python_limits(900.0, 600.0)
    assert long.wall_seconds == 600.0 and long.cpu_seconds >= 5 * 600  # several such cells a session
    assert python_limits(300.0, 10.0).wall_seconds == 10.0
    for tool_timeout, cell in ((300.0, 600.0), (300.0, 298.0), (300.0, 0.5)):
        with pytest.raises(ValueError, match="--python-timeout"):
            python_limits(tool_timeout, cell)


def test_tool_timeouts_reach_the_tool_servers(tiny_checkpoint, tmp_path, monkeypatch):
    # `--tool-timeout` bounds every tool call the agent loop makes, MCP ones included: an MCP
    # tool must not be cut off at the client's own 60 s default under `--tool-timeout 300`; and
    # `--python-timeout` lengthens a python cell past the sandbox's default 60 s.
    import asyncio

    import agent_server.app
    import tools.servers

    factories, started = [], {}

    def fake_create_app(config, engine_factory, *, tool_servers=None, **kwargs):
        factories.append(tool_servers)
        return object()

    async def fake_start_tool_servers(specs, **options):
        started.update(options)
        return []

    monkeypatch.setattr(agent_server.app, "create_app", fake_create_app)
    monkeypatch.setattr(tools.servers, "start_tool_servers", fake_start_tool_servers)
    with socket.create_server(("127.0.0.1", 0)) as listening:  # (serve checks that an MCP server is there)
        port = listening.getsockname()[1]
        serve_captured(
            [
                "--model",
                str(tiny_checkpoint),
                "--store",
                str(tmp_path / "r.db"),
                "--tool-server",
                f"127.0.0.1:{port}",
                "--tool-timeout",
                "900",
                "--python-timeout",
                "600",
            ]
        )
    asyncio.run(factories[0]())
    assert started["mcp_timeout"] == 900.0 and started["python_limits"].wall_seconds == 600.0
    # A cell limit that does not fit under the call's is refused before anything starts.
    from agent_server.cli.main import build_parser
    from agent_server.cli.serve import run

    assert run(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), "--python-timeout", "600"])) == 2


@pytest.mark.parametrize("where", [".", "./", "snapshot"])
def test_the_default_served_name_is_the_models_name(where, tmp_path, monkeypatch):
    # `--model .` from inside the checkpoint folder, or a Hugging Face cache snapshot
    # (.../models--openai--gpt-oss-20b/snapshots/<commit>): served as "gpt-oss-20b", not "" or
    # the commit hash.
    folder = tmp_path / "gpt-oss-20b"
    if where == "snapshot":
        folder = tmp_path / "hub" / "models--openai--gpt-oss-20b" / "snapshots" / ("d666cf3b" * 5)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(folder)
    model = str(folder) if where == "snapshot" else where
    served = serve_captured(["--model", model, "--store", str(tmp_path / "r.db")])
    assert served["app"].state.server.config.model_name == "gpt-oss-20b"


def test_a_model_path_with_a_tilde_is_the_home_folder(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    # `--model=~/models/gpt-oss-20b` (or a quoted path): the shell leaves the "~" alone.
    import shutil

    from agent_server.cli.main import main

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_checkpoint, tmp_path / "gpt-oss-20b")
    served = serve_captured(["--model=~/gpt-oss-20b", "--store", str(tmp_path / "r.db")])
    assert served["app"].state.server.config.model_name == "gpt-oss-20b"
    assert main(["generate", "--model=~/gpt-oss-20b", "--max-tokens", "1", "--device", "cpu", "hi"]) == 0


def test_generate_on_cuda_without_cuda_is_an_error(tiny_checkpoint, capsys, monkeypatch):
    import torch

    from agent_server.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--model", str(tiny_checkpoint), "--device", "cuda", "hi"]) == 2
    assert "--device cuda" in capsys.readouterr().err


@pytest.mark.parametrize("problem", ["no folder", "no weights", "corrupt shard"])
def test_generate_reports_a_bad_model_folder_without_a_traceback(problem, tiny_checkpoint, tmp_path, capsys):
    import shutil

    from agent_server.cli.main import main

    folder = tmp_path / "model"
    if problem != "no folder":
        shutil.copytree(tiny_checkpoint, folder)
        weights = folder / "model.safetensors"
        if problem == "no weights":
            weights.unlink()
        else:
            weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["generate", "--model", str(folder), "--device", "cpu", "hi"]) != 0  # raised nothing
    err = capsys.readouterr().err
    assert str(folder) in err and "Traceback" not in err


def test_a_folder_holding_only_the_original_layout_is_explained(tmp_path, caplog, monkeypatch):
    # `hf download openai/gpt-oss-20b --include "original/*" --local-dir gpt-oss-20b` (as
    # gpt-oss's own README has it) leaves gpt-oss-20b/original/ and no config.json above it.
    import uvicorn

    from agent_server.cli.serve import run

    (tmp_path / "gpt-oss-20b" / "original").mkdir(parents=True)
    (tmp_path / "gpt-oss-20b" / "original" / "config.json").write_text("{}")
    monkeypatch.setattr(uvicorn, "Server", None)
    with caplog.at_level(logging.ERROR, logger="oss_agent"):
        assert run(build_parser().parse_args(["serve", "--model", str(tmp_path / "gpt-oss-20b")])) == 2
    assert "original/" in caplog.text and "no config.json" in caplog.text


def test_a_search_dir_without_a_browser_is_refused(tiny_checkpoint, tmp_path, caplog, monkeypatch):
    # The README lists --search-dir as the browser's backend; with no browser tool server it did
    # nothing, and web_search_preview requests were refused as if it had not been given.
    import uvicorn

    from agent_server.cli.serve import run

    monkeypatch.setattr(uvicorn, "Server", None)
    with caplog.at_level(logging.ERROR, logger="oss_agent"):
        assert (
            run(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), "--search-dir", str(tmp_path)]))
            == 2
        )
    assert "--tool-server" in caplog.text
    served = serve_captured(
        [
            "--model",
            str(tiny_checkpoint),
            "--search-dir",
            str(tmp_path),
            "--tool-server",
            "demo",
            "--store",
            str(tmp_path / "r.db"),
        ]
    )
    assert served["app"] is not None


@pytest.mark.parametrize(
    "flag, path, complaint", [("--search-dir", "nowhere", "not a folder"), ("--store", ".", "is a folder")]
)
def test_paths_that_cannot_work_are_named(flag, path, complaint, tiny_checkpoint, tmp_path, caplog, monkeypatch):
    # (a missing --search-dir was a traceback when the browser started; a folder as --store was
    # SQLite's "unable to open database file", naming no path)
    import uvicorn

    from agent_server.cli.serve import run

    monkeypatch.setattr(uvicorn, "Server", None)
    with caplog.at_level(logging.ERROR, logger="oss_agent"):
        assert (
            run(
                build_parser().parse_args(
                    ["serve", "--model", str(tiny_checkpoint), "--tool-server", "demo", flag, str(tmp_path / path)]
                )
            )
            == 2
        )
    assert flag in caplog.text and complaint in caplog.text


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-model-len", "0"],
        ["--max-request-bytes", "0"],
        ["--max-input-items", "0"],
        ["--tool-timeout", "0"],
        ["--tool-timeout", "-1"],
        ["--shutdown-timeout", "-1"],
    ],
)
def test_serve_settings_that_cannot_work_are_argument_errors(argv, capsys):
    # (--max-model-len 0 was silently the default; --max-request-bytes 0 refused every request)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *argv])
    assert exit_info.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--draft-model", "/models/eagle3"],
        ["--num-draft-tokens", "3"],
        ["--speculative", "ngram", "--draft-model", "/models/eagle3"],
    ],
)
def test_draft_flags_without_their_drafter_are_refused(argv):
    # They did nothing: no drafter ran, and nothing said so.
    from agent_server.cli.serve import engine_options

    with pytest.raises(SystemExit, match="--speculative"):
        engine_options(build_parser().parse_args(["serve", *argv]))
    # A drafter chosen through --engine-option counts.
    args = build_parser().parse_args(["serve", "--engine-option", "speculative=ngram", "--num-draft-tokens", "3"])
    assert engine_options(args)["num_draft_tokens"] == 3


@pytest.mark.slow
def test_uvicorns_own_log_lines_have_the_servers_format(tmp_path):
    # One format for every line (time, level, logger, request id): uvicorn's start-up lines and
    # its errors were written in its own ("INFO:     Started server process ...").
    import json
    import re
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # fails to load: exits
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_server.cli",
            "serve",
            "--model",
            str(tmp_path),
            "--port",
            "0",
            "--store",
            str(tmp_path / "r.db"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    lines = [line for line in result.stderr.splitlines() if "Started server process" in line or "Shutting down" in line]
    assert lines and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO \S+ \[-\] ", line) for line in lines)


def test_every_flag_the_readme_names_exists():
    # The README's serving table and `oss-agent serve` lines name flags; a renamed or dropped flag
    # must not leave it promising one that `serve` refuses.
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    table = readme.split("### Serving options", 1)[1].split("\n#", 1)[0]
    serve_lines = "\n".join(re.findall(r"oss-agent serve[^\n]*", readme))
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", table + serve_lines))
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {option for action in serve._actions for option in action.option_strings}
    assert len(flags) > 15 and flags <= known, flags - known


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        return listening.getsockname()[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tool-server", "bogus"],
            "--tool-server: expected demo, browser, python, host:port, an http(s):// URL, or "
            "label=<host:port or URL> for a tool server, got 'bogus'",
        ),
        (
            ["--tool-server", "demo,127.0.0.1:{port}"],
            "--tool-server: cannot reach the MCP server '127.0.0.1:{port}' at http://127.0.0.1:{port}/mcp: ",
        ),
        (["--device", "cuda"], "--device cuda: this machine has no CUDA device torch can use"),
        (["--device", "tpu"], "--device tpu: not a device"),
    ],
)
@pytest.mark.slow
def test_a_bad_tool_server_or_device_is_one_line_before_the_server_starts(argv, message, tiny_checkpoint, tmp_path):
    # A bogus --tool-server printed "Uvicorn running on ..." and then two chained tracebacks before
    # the one-line cause; an unreachable MCP server the same; --device cuda with no GPU was 30
    # lines of traceback. Now: the cause in one line, nothing started, exit status 2.
    import os
    import subprocess
    import sys

    port = closed_port()
    argv = [a.format(port=port) for a in argv]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # (a machine with no GPU, even on a GPU host)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_server.cli",
            "serve",
            "--model",
            str(tiny_checkpoint),
            "--store",
            str(tmp_path / "r.db"),
            "--port",
            "0",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].split(" [-] ", 1)[1].startswith(message.format(port=port)), result.stderr
    assert "Traceback" not in result.stderr and "Uvicorn running" not in result.stderr


def test_the_store_is_named_in_help_and_log(tiny_checkpoint, tmp_path, caplog, capsys, monkeypatch):
    # Every server started without --store shares one file; a user could not find out where it was.
    monkeypatch.setenv("OSS_AGENT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "~/.cache/oss-agent/responses.sqlite3" in " ".join(capsys.readouterr().out.split())
    with caplog.at_level(logging.INFO, logger="oss_agent"):
        serve_captured(["--model", str(tiny_checkpoint)])
    assert f"stored responses: {tmp_path / 'cache' / 'responses.sqlite3'} (shared by every server" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="oss_agent"):
        serve_captured(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "mine.db")])
    assert f"stored responses: {tmp_path / 'mine.db'}\n" in caplog.text + "\n"


def test_the_random_default_model_is_capped_named_and_says_so(tmp_path, caplog, monkeypatch):
    # With no --model, the tiny random checkpoint wrote noise until its context was full (98 s);
    # the README's snippet asked for gpt-oss-20b and got a 404.
    from agent_server import default_model

    monkeypatch.setenv("OSS_AGENT_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="oss_agent"):
        config = serve_captured([])["app"].state.server.config
    assert (config.model_name, config.random_weights, config.default_max_output_tokens) == (
        "gpt-oss-tiny-random",
        True,
        default_model.MAX_OUTPUT_TOKENS,
    )
    assert config.serves("gpt-oss-20b") and config.serves("gpt-oss-120b") and not config.serves("gpt-4o")
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "random weights" in warning and "noise" in warning and "hf download openai/gpt-oss-20b" in warning
    assert f"at most {default_model.MAX_OUTPUT_TOKENS} output tokens" in warning
    assert "--default-max-output-tokens" in warning and "gpt-oss-20b and gpt-oss-120b" in warning
    # The cap can be changed or lifted; a real model has none and answers only to its own names.
    assert (
        serve_captured(["--default-max-output-tokens", "500"])["app"].state.server.config.default_max_output_tokens
        == 500
    )
    assert (
        serve_captured(["--default-max-output-tokens", "0"])["app"].state.server.config.default_max_output_tokens
        is None
    )
    (tmp_path / "gpt-oss-20b").mkdir()
    (tmp_path / "gpt-oss-20b" / "config.json").write_text("{}")
    config = serve_captured(["--model", str(tmp_path / "gpt-oss-20b")])["app"].state.server.config
    assert (config.random_weights, config.default_max_output_tokens) == (False, None)
    assert not config.serves("gpt-oss-120b")


@pytest.mark.slow
def test_a_tool_server_that_is_there_but_no_mcp_server_fails_in_one_line(tiny_checkpoint, tmp_path):
    # Something listens, so the check before startup passes; the MCP handshake then fails while
    # the server starts. That is the configuration's fault: one line, not two chained tracebacks.
    import http.server
    import subprocess
    import sys
    import threading

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        spec = f"127.0.0.1:{web.server_address[1]}"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "agent_server.cli",
                "serve",
                "--model",
                str(tiny_checkpoint),
                "--store",
                str(tmp_path / "r.db"),
                "--port",
                "0",
                "--tool-server",
                spec,
                "--tool-timeout",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(Path(__file__).resolve().parents[3]),
        )
    finally:
        web.shutdown()
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert (
        f"startup failed: could not start tool server: cannot reach the MCP server at http://{spec}/mcp"
        in result.stderr
    )
