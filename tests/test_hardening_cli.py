"""`oss-agent serve` hardening flags reach the app and uvicorn (uvicorn.run is captured, so no
server starts and no model loads: the engine is only built in the app's startup)."""

from __future__ import annotations

import logging

import pytest

from agent_server.cli import build_parser
from agent_server.request_ids import RequestIdFilter


@pytest.fixture
def served(monkeypatch):
    import uvicorn

    captured = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: captured.update(app=app, **kwargs))
    root = logging.getLogger()
    before = {h: list(h.filters) for h in root.handlers}
    yield captured
    for handler, filters in before.items():
        handler.filters[:] = filters


def serve(argv):
    from agent_server.serve_command import run

    args = build_parser().parse_args(["serve", *argv])
    assert run(args) == 0
    return args


def test_hardening_flags(served, tiny_checkpoint, tmp_path):
    serve(["--model", str(tiny_checkpoint), "--api-key", "k1", "--cors-origin", "https://a.example",
           "--cors-origin", "https://b.example", "--max-request-bytes", "1000", "--max-input-items", "7",
           "--shutdown-timeout", "4.5", "--store", str(tmp_path / "r.db")])
    config = served["app"].state.server.config
    assert config.api_key == "k1"
    assert config.cors_origins == ["https://a.example", "https://b.example"]
    assert (config.max_request_bytes, config.max_input_items, config.shutdown_timeout) == (1000, 7, 4.5)
    # uvicorn gives open connections the same deadline, and our access log (with request ids)
    # replaces its own.
    assert served["timeout_graceful_shutdown"] == 4.5 and served["access_log"] is False
    assert any(isinstance(f, RequestIdFilter) for h in logging.getLogger().handlers for f in h.filters)


def test_defaults_are_safe(served, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("OSS_AGENT_API_KEY", raising=False)
    serve(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db")])
    config = served["app"].state.server.config
    assert config.api_key is None and config.cors_origins == []  # CORS off unless configured
    assert config.max_request_bytes > 0 and config.max_input_items > 0 and config.shutdown_timeout > 0


def test_api_key_from_the_environment(served, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("OSS_AGENT_API_KEY", "from-env")
    serve(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db")])
    assert served["app"].state.server.config.api_key == "from-env"


def test_listening_beyond_loopback_without_a_key_warns(served, tiny_checkpoint, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("OSS_AGENT_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING, logger="oss_agent"):
        serve(["--model", str(tiny_checkpoint), "--host", "0.0.0.0", "--store", str(tmp_path / "r.db")])
    assert any("without --api-key" in r.getMessage() for r in caplog.records)
