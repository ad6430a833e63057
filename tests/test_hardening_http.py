"""The HTTP edge against clients that are not what they claim: web pages reaching a loopback
server (DNS rebinding, cross-site POSTs) and slow or oversized request heads.

Host: only served names are answered (loopback names, IP addresses, the bound host and
`--allowed-host`), so a page whose name was rebound to 127.0.0.1 reads nothing. Content type:
the API's POSTs want `application/json`, as OpenAI's do, so a page cannot start a generation
with a "simple" cross-site POST. Both with the real clients still working: the openai SDK and
the playground page.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MODEL, LiveServer, make_app, serve_captured
from tests.fake_engine import ScriptedEngine

HELLO = b'{"model": "%s", "input": "hi"}' % MODEL.encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app = make_app(lambda: ScriptedEngine(), tmp_path_factory.mktemp("http") / "r.db",
                   allowed_hosts=["127.0.0.1", "models.example.lan", "*.corp.example"])
    with LiveServer(app) as live:
        live.port = int(live.url.rsplit(":", 1)[1])
        yield live


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


# --- Host -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/"), ("GET", "/v1/models"),
                                         ("POST", "/v1/responses"), ("POST", "/v1/chat/completions")])
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "corp.example",
                                  "models.example.lan.evil.example"])
def test_a_rebound_name_is_refused(server, method, path, host):
    r = httpx.request(method, server.url + path, headers={"Host": host, "Content-Type": "application/json"},
                      content=HELLO if method == "POST" else None)
    error = error_of(r)
    assert error["code"] == "invalid_host" and "--allowed-host" in error["message"]
    assert "x-request-id" in r.headers


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "LOCALHOST:{port}", "127.0.0.1:{port}",
                                  "[::1]:{port}", "app.localhost:{port}", "192.168.1.20:{port}", "10.0.0.1",
                                  "[fe80::1]", "models.example.lan", "models.example.lan.:{port}",
                                  "a.corp.example:{port}", "b.a.corp.example"])
def test_served_names_are_answered(server, host):
    r = httpx.post(f"{server.url}/v1/responses", content=HELLO,
                   headers={"Host": host.format(port=server.port), "Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["status"] == "completed"


def test_any_host_with_a_star(tmp_path):
    with LiveServer(make_app(lambda: ScriptedEngine(), tmp_path / "r.db", allowed_hosts=["*"])) as live:
        r = httpx.get(f"{live.url}/v1/models", headers={"Host": "anything.example"})
        assert r.status_code == 200


def test_serve_answers_its_host_and_the_allowed_hosts(tiny_checkpoint, tmp_path):
    served = serve_captured(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db"), "--host",
                             "box.lan", "--allowed-host", "a.example", "--allowed-host", "*.b.example"])
    assert served["app"].state.server.config.allowed_hosts == ["box.lan", "a.example", "*.b.example"]
    served = serve_captured(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db")])
    assert served["app"].state.server.config.allowed_hosts == ["127.0.0.1"]


# --- content type ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx", "", None])
def test_an_api_post_that_is_not_json_is_refused(server, path, content_type):
    # What a page can send to any origin without a CORS preflight, with a JSON body all the same.
    body = HELLO if path == "/v1/responses" else b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' \
        % MODEL.encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    request = httpx.Request("POST", server.url + path, content=body, headers=headers)
    assert ("content-type" in request.headers) == (content_type is not None)
    r = httpx.Client().send(request)
    error = error_of(r)
    assert error["code"] == "unsupported_content_type" and "application/json" in error["message"]
    if content_type:
        assert f"'{content_type}'" in error["message"]


def test_openais_words_for_a_wrong_content_type(server):
    error = error_of(httpx.post(f"{server.url}/v1/responses", content=HELLO, headers={"Content-Type": "text/plain"}))
    assert error == {"message": "Unsupported content type: 'text/plain'. This API method only accepts "
                                "'application/json' requests, but you specified the header 'Content-Type: "
                                "text/plain'. Please try again with a supported content type.",
                     "type": "invalid_request_error", "param": None, "code": "unsupported_content_type"}


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_with_any_parameters_is_taken(server, content_type):
    r = httpx.post(f"{server.url}/v1/responses", content=HELLO, headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text[:300]


def test_a_post_with_no_body_needs_no_content_type(server):
    # POST /v1/responses/{id}/cancel carries nothing: curl sends it with no content type.
    created = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "background": True})
    r = httpx.Client().send(httpx.Request("POST", f"{server.url}/v1/responses/{created.json()['id']}/cancel"))
    assert r.status_code == 200 and r.json()["background"] is True
    assert httpx.post(f"{server.url}/v1/responses/resp_missing/cancel").status_code == 404


def test_the_sdk_and_the_playground_still_work(server):
    client = server.client()
    response = client.responses.create(model=MODEL, input="hi", background=True)
    assert client.responses.cancel(response.id).id == response.id
    assert client.responses.create(model=MODEL, input="hi").status == "completed"
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]).choices
    assert client.responses.delete(response.id) is None
    page = httpx.get(f"{server.url}/", headers={"Host": f"localhost:{server.port}"})
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert httpx.get(f"{server.url}/static/api.js").status_code == 200
