"""The HTTP edge against clients that are not what they claim: web pages reaching a loopback
server (DNS rebinding, cross-site POSTs) and slow or oversized request heads and bodies.

Host: only served names are answered (loopback names, IP addresses, the bound host and
`--allowed-host`), so a page whose name was rebound to 127.0.0.1 reads nothing. Content type:
the API's POSTs want `application/json`, as OpenAI's do, so a page cannot start a generation
with a "simple" cross-site POST. Both with the real clients still working: the openai SDK and
the playground page.

Slow clients, with real sockets against the live uvicorn server `oss-agent serve` runs
(`agent_server.http_limits`): connections that never finish their head (slowloris), heads past
the size limit, silent connections and trickled bodies are closed on time, while another
client keeps getting answers quickly.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from agent_server.bench.server_metrics import parse_metrics
from agent_server.http_limits import HttpLimits, LimitedHttpToolsProtocol
from tests.conftest import MODEL, LiveServer, make_app, serve_captured
from tests.fake_engine import ScriptedEngine

HELLO = b'{"model": "%s", "input": "hi"}' % MODEL.encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app = make_app(
        lambda: ScriptedEngine(),
        tmp_path_factory.mktemp("http") / "r.db",
        allowed_hosts=["127.0.0.1", "models.example.lan", "*.corp.example"],
    )
    with LiveServer(app) as live:
        live.port = int(live.url.rsplit(":", 1)[1])
        yield live


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


# --- Host -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/health"),
        ("GET", "/"),
        ("GET", "/v1/models"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/chat/completions"),
    ],
)
@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:8000", "localhost.evil.example", "corp.example", "models.example.lan.evil.example"],
)
def test_a_rebound_name_is_refused(server, method, path, host):
    r = httpx.request(
        method,
        server.url + path,
        headers={"Host": host, "Content-Type": "application/json"},
        content=HELLO if method == "POST" else None,
    )
    error = error_of(r)
    assert error["code"] == "invalid_host" and "--allowed-host" in error["message"]
    assert "x-request-id" in r.headers


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:{port}",
        "LOCALHOST:{port}",
        "127.0.0.1:{port}",
        "[::1]:{port}",
        "app.localhost:{port}",
        "192.168.1.20:{port}",
        "10.0.0.1",
        "[fe80::1]",
        "models.example.lan",
        "models.example.lan.:{port}",
        "a.corp.example:{port}",
        "b.a.corp.example",
    ],
)
def test_served_names_are_answered(server, host):
    r = httpx.post(
        f"{server.url}/v1/responses",
        content=HELLO,
        headers={"Host": host.format(port=server.port), "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["status"] == "completed"


def test_any_host_with_a_star(tmp_path):
    with LiveServer(make_app(lambda: ScriptedEngine(), tmp_path / "r.db", allowed_hosts=["*"])) as live:
        r = httpx.get(f"{live.url}/v1/models", headers={"Host": "anything.example"})
        assert r.status_code == 200


def test_serve_answers_its_host_and_the_allowed_hosts(tiny_checkpoint, tmp_path):
    served = serve_captured(
        [
            "--model",
            str(tiny_checkpoint),
            "--store",
            str(tmp_path / "r.db"),
            "--host",
            "box.lan",
            "--allowed-host",
            "a.example",
            "--allowed-host",
            "*.b.example",
        ]
    )
    assert served["app"].state.server.config.allowed_hosts == ["box.lan", "a.example", "*.b.example"]
    served = serve_captured(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db")])
    assert served["app"].state.server.config.allowed_hosts == ["127.0.0.1"]


# --- content type ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "",
        None,
    ],
)
def test_an_api_post_that_is_not_json_is_refused(server, path, content_type):
    # What a page can send to any origin without a CORS preflight, with a JSON body all the same.
    body = (
        HELLO
        if path == "/v1/responses"
        else b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
    )
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
    assert error == {
        "message": "Unsupported content type: 'text/plain'. This API method only accepts "
        "'application/json' requests, but you specified the header 'Content-Type: "
        "text/plain'. Please try again with a supported content type.",
        "type": "invalid_request_error",
        "param": None,
        "code": "unsupported_content_type",
    }


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"]
)
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


# --- slow and oversized requests ------------------------------------------------------------

LIMITS = HttpLimits(max_head_bytes=16 << 10, head_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0)


@pytest.fixture
def limited(tmp_path):
    with LiveServer(make_app(lambda: ScriptedEngine(), tmp_path / "r.db"), limits=LIMITS) as live:
        live.port = int(live.url.rsplit(":", 1)[1])
        yield live


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (or 10 s pass)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, socket.timeout):
        pass
    return b"".join(chunks)


class Attack:
    """Clients in threads: each sends `first`, then `piece` every `every` seconds until the
    server closes the connection or `until` passes. Records what the server answered, when
    it closed, and how many bytes got through."""

    def __init__(self, server, clients: int, first: bytes, piece: bytes, every: float, until: float):
        self.results: list[dict] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._one, args=(server, first, piece, every, until), daemon=True)
            for _ in range(clients)
        ]

    def _one(self, server, first, piece, every, until):
        sock = connect(server)
        started, sent, answer = time.monotonic(), 0, b""
        closed_at = None
        try:
            sock.sendall(first)
            sent += len(first)
            sock.setblocking(False)
            while time.monotonic() - started < until:
                try:
                    data = sock.recv(65536)
                    if not data:
                        closed_at = time.monotonic() - started
                        break
                    answer += data
                except BlockingIOError:
                    pass
                try:
                    sock.send(piece)
                    sent += len(piece)
                except BlockingIOError:
                    pass
                time.sleep(every)
        except (BrokenPipeError, ConnectionResetError):
            closed_at = time.monotonic() - started
        finally:
            sock.close()
        with self.lock:
            self.results.append({"answer": answer, "closed_at": closed_at, "sent": sent})

    def start(self) -> "Attack":
        for t in self.threads:
            t.start()
        return self

    def join(self) -> list[dict]:
        for t in self.threads:
            t.join(timeout=30)
        return self.results


def probe_latencies(server, seconds: float) -> list[float]:
    """An ordinary client's requests during an attack: each one's time to answer."""
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.02)
    return latencies


def server_errors(server) -> float:
    """5xx answers so far (but /ready's while the model loads)."""
    samples = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "oss_agent_requests_total"
        and dict(labels)["status"].startswith("5")
        and dict(labels)["endpoint"] != "/ready"
    )


def test_serve_runs_the_limits_it_is_given(tiny_checkpoint, tmp_path):
    served = serve_captured(
        [
            "--model",
            str(tiny_checkpoint),
            "--store",
            str(tmp_path / "r.db"),
            "--max-header-bytes",
            "9000",
            "--header-timeout",
            "3",
            "--body-timeout",
            "7",
        ]
    )
    assert issubclass(served["http"], LimitedHttpToolsProtocol)
    assert served["http"].limits == HttpLimits(max_head_bytes=9000, head_timeout=3.0, body_timeout=7.0)
    defaults = serve_captured(["--model", str(tiny_checkpoint), "--store", str(tmp_path / "r.db")])
    assert defaults["http"].limits == HttpLimits() and defaults["timeout_keep_alive"] == HttpLimits().keep_alive_timeout


def test_slowloris_does_not_hold_other_clients_and_is_cut_off(limited):
    # 24 connections that never finish a header line, a byte every 50 ms (slowloris), and 4 that
    # send one endless header line as fast as they can in 100-byte pieces.
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    slow = Attack(limited, 24, head, b"a", 0.05, until=6.0).start()
    fast = Attack(limited, 4, head, b"b" * 100, 0.0005, until=6.0).start()
    latencies = probe_latencies(limited, 2.5)
    slow_results, fast_results = slow.join(), fast.join()
    # The ordinary client was answered quickly throughout.
    assert max(latencies) < 0.5, sorted(latencies)[-5:]
    # Each slow head was cut off with a 408 soon after the head timeout.
    for result in slow_results:
        assert result["closed_at"] is not None and result["closed_at"] < LIMITS.head_timeout + 1.5, result
        assert result["answer"].startswith(b"HTTP/1.1 408 "), result["answer"][:100]
    # Each endless line was refused with a 431 once it passed the size limit.
    for result in fast_results:
        assert result["answer"].startswith(b"HTTP/1.1 431 "), result["answer"][:100]
        assert result["closed_at"] is not None and result["closed_at"] < LIMITS.head_timeout + 1.5, result
        assert b'"code": "request_header_fields_too_large"' in result["answer"]
    assert server_errors(limited) == 0
    assert probe_latencies(limited, 0.2)


def test_a_silent_connection_is_closed(limited):
    sock = connect(limited)
    started = time.monotonic()
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < LIMITS.head_timeout + 1.5
    # Idle between requests: the keep-alive timeout closes it.
    sock = connect(limited)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    started = time.monotonic()
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1
    assert time.monotonic() - started < LIMITS.keep_alive_timeout + 1.5


def test_a_trickled_body_is_cut_off(limited):
    # A body of 1000 bytes sent a byte every 50 ms would take 50 s; the body timeout is 1 s.
    head = (
        b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    results = Attack(limited, 8, head, b" ", 0.05, until=6.0).start()
    latencies = probe_latencies(limited, 1.5)
    for result in results.join():
        assert result["closed_at"] is not None and result["closed_at"] < LIMITS.body_timeout + 1.5, result
        assert b"HTTP/1.1 5" not in result["answer"]
    assert max(latencies) < 0.5
    assert server_errors(limited) == 0


def test_heads_in_pieces_pipelined_or_at_the_limit_are_served(limited):
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    # Byte by byte (the blank line split across reads, too).
    sock = connect(limited)
    for i in range(len(request)):
        sock.sendall(request[i : i + 1])
        time.sleep(0.005)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert read_all(sock).count(b"HTTP/1.1 200 ") == 2
    # Pipelined: three requests in one write, the last closing the connection.
    sock = connect(limited)
    sock.sendall(request * 2 + b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    answer = read_all(sock)
    assert answer.count(b"HTTP/1.1 200 ") == 3 and answer.endswith(b"}")
    # A body in the same write as its head, and a head just under the size limit.
    body = b'{"model": "%s", "input": "hi"}' % MODEL.encode()
    padding = b"X-Pad: " + b"p" * (LIMITS.max_head_bytes - 300) + b"\r\n"
    sock = connect(limited)
    sock.sendall(
        b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\n" + padding + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"completed"' in answer
    # A small head whose body, in the same write, is far larger than the head limit.
    words = b"word " * (LIMITS.max_head_bytes // 4)
    body = b'{"model": "%s", "input": "hi", "instructions": "%s"}' % (MODEL.encode(), words)
    sock = connect(limited)
    sock.sendall(
        b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"completed"' in answer
    # Bare LF line ends: answered at once one way or the other, not left waiting.
    sock = connect(limited)
    started = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\nHost: 127.0.0.1\nConnection: close\n\n")
    answer = read_all(sock)
    assert answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 400 ")) and time.monotonic() - started < 0.9
