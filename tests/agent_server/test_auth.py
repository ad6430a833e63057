"""API keys, CORS, request ids, and what an unexpected error shows a client.

`--api-key`: every endpoint except /health (and the public playground page) answers 401 with
an OpenAI-style body unless `Authorization: Bearer <key>` is right, and the key is checked with
`hmac.compare_digest` (a spy proves it). CORS is off unless origins are configured. Every
response carries an `x-request-id`, which also tags the log lines of that request.
"""

from __future__ import annotations

import hmac
import logging

import httpx
import openai
import pytest

from agent_server.request_ids import RequestIdFilter
from tests.conftest import MODEL, LiveServer, make_app
from tests.fake_engine import ScriptedEngine

KEY = "sk-test-0123456789"
PROTECTED = [
    ("GET", "/ready", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi"}),
    ("GET", "/v1/responses/resp_123", None),
    ("DELETE", "/v1/responses/resp_123", None),
    ("POST", "/v1/responses/resp_123/cancel", None),
    ("GET", "/v1/responses/resp_123/input_items", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/no-such-route", None),  # unknown routes do not reveal themselves either
]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    engine = ScriptedEngine()
    app = make_app(lambda: engine, tmp_path_factory.mktemp("auth") / "r.db", api_key=KEY)
    with LiveServer(app, api_key=KEY) as server:
        yield server


def assert_401(r: httpx.Response) -> dict:
    assert r.status_code == 401, (r.request.method, r.request.url, r.status_code, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert KEY not in r.text
    return error


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_every_endpoint_but_health_wants_the_key(keyed, method, path, body):
    missing = assert_401(httpx.request(method, keyed.url + path, json=body))
    assert "missing" in missing["message"].lower()
    for header in (
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        "Bearer",
        f"Basic {KEY}",
        KEY,
        f"Token {KEY}",
        f"Bearer {KEY.upper()}",
    ):
        wrong = assert_401(httpx.request(method, keyed.url + path, json=body, headers={"Authorization": header}))
        assert "incorrect" in wrong["message"].lower()
    r = httpx.request(method, keyed.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code != 401
    r = httpx.request(method, keyed.url + path, json=body, headers={"authorization": f"bearer  {KEY}"})
    assert r.status_code != 401  # the scheme is case-insensitive, extra spaces do not matter


def test_health_and_the_playground_page_are_public(keyed):
    assert httpx.get(f"{keyed.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{keyed.url}/").status_code != 401
    assert httpx.get(f"{keyed.url}/static/app.js").status_code != 401
    # ...but nothing that merely starts like them.
    assert_401(httpx.get(f"{keyed.url}/healthz"))
    assert_401(httpx.get(f"{keyed.url}/static"))


def test_the_sdk_works_with_the_key_and_fails_without(keyed):
    assert keyed.client().responses.create(model=MODEL, input="hi").status == "completed"
    assert keyed.client().models.list().data[0].id == MODEL
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "invalid_api_key"


def test_keys_are_compared_with_compare_digest(keyed, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert len(calls) == 2
    # Digests of equal length are compared, never the raw strings: timing says nothing of the key.
    for a, b in calls:
        assert isinstance(a, bytes) and len(a) == len(b) == 32 and KEY.encode() not in (a, b)


def test_no_key_configured_means_no_auth(fake_server):
    assert httpx.get(f"{fake_server.url}/v1/models").status_code == 200
    assert httpx.get(f"{fake_server.url}/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_cors_is_off_by_default(fake_server):
    preflight = httpx.options(
        f"{fake_server.url}/v1/responses",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    r = httpx.get(f"{fake_server.url}/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_allows_only_the_configured_origins_and_still_wants_the_key(tmp_path):
    app = make_app(ScriptedEngine, tmp_path / "r.db", api_key=KEY, cors_origins=["https://app.example"])
    with LiveServer(app, api_key=KEY) as server:
        preflight = httpx.options(
            f"{server.url}/v1/responses",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200  # a preflight carries no key and must not need one
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            f"{server.url}/v1/responses",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example"})
        assert_401(r)
        assert r.headers["access-control-allow-origin"] == "https://app.example"  # the browser can read the 401
        r = httpx.get(
            f"{server.url}/v1/models", headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 200 and "x-request-id" in r.headers["access-control-expose-headers"]


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def server_logs():
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("oss_agent", "agent_server")]
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield handler.records
    for lg, level in saved:
        lg.removeHandler(handler)
        lg.setLevel(level)


def test_request_ids_are_in_headers_and_logs(fake_server, server_logs):
    r1 = httpx.get(f"{fake_server.url}/v1/models")
    r2 = httpx.post(f"{fake_server.url}/v1/responses", json={"model": MODEL})
    ids = {r1.headers["x-request-id"], r2.headers["x-request-id"]}
    assert len(ids) == 2 and all(i.startswith("req_") and len(i) == 36 for i in ids)
    # A client's own id is kept when it is a plain token, replaced when it could forge a log line.
    r3 = httpx.get(f"{fake_server.url}/health", headers={"x-request-id": "trace-42.a"})
    assert r3.headers["x-request-id"] == "trace-42.a"
    r4 = httpx.get(f"{fake_server.url}/health", headers={"x-request-id": 'x" forged=1'})
    assert r4.headers["x-request-id"].startswith("req_")
    access = {rec.request_id: rec.getMessage() for rec in server_logs if rec.name == "oss_agent.access"}
    assert access[r1.headers["x-request-id"]].startswith("GET /v1/models 200")
    assert access[r2.headers["x-request-id"]].startswith("POST /v1/responses 400")
    assert access["trace-42.a"].startswith("GET /health 200")


def test_unexpected_errors_show_no_internals(fake_server, server_logs, monkeypatch):
    from agent_server.responses import prepare as responses_api

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail at /srv/app/x.py")

    monkeypatch.setattr(responses_api, "render_prompt", broken)
    http = httpx.Client(base_url=fake_server.url)
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
    request_id = r.headers["x-request-id"]
    assert request_id in error["message"]  # what to quote when reporting it
    logged = [rec for rec in server_logs if rec.request_id == request_id and rec.exc_info]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])
    # The same connection keeps working.
    monkeypatch.undo()
    assert http.post("/v1/responses", json={"model": MODEL, "input": "hi"}).status_code == 200
