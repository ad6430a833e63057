"""Requests a web page makes on another site's behalf: DNS rebinding and cross-site POSTs.

Served without a key on loopback, the server trusts whoever can reach the port, and a web page
the user visits can reach it too, in two ways this middleware closes:

- DNS rebinding: the page's own name is made to resolve to 127.0.0.1, so the browser treats the
  server as same-origin with the page and lets it read the answers. Those requests carry the
  page's name in `Host`: only served names are answered (loopback names, IP addresses, the
  bound host and `--allowed-host` names; `*` allows any). An IP address cannot be rebound, so
  it is always allowed, which keeps a LAN client by address working.
- Cross-site POSTs: a page may POST to any origin without asking, but only as a "simple"
  request (text/plain, a form, or no content type at all). The API's POSTs want
  `application/json`, as OpenAI's do, and anything else is refused before the body is read;
  a page that sends JSON must first pass a CORS preflight, which only `--cors-origin` allows.
"""

from __future__ import annotations

import ipaddress

from agent_server.errors import APIError
from agent_server.responses.dialect import api_path

LOOPBACK_NAMES = frozenset({"localhost"})


def host_name(header: bytes) -> str:
    """The name of a Host header, without the port, lower case (`[::1]:8000` -> `::1`)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].partition("]")[0]
    name, _, port = text.rpartition(":")
    return (name if name and port.isdigit() else text).rstrip(".")


def is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class AllowedHosts:
    """The names the server answers for: loopback names (`localhost` and its subdomains, which
    resolve to loopback only), every IP address, and the given names; `*.example.com` allows
    its subdomains, `*` any name."""

    def __init__(self, names: list[str]):
        cleaned = {n.strip().lower().rstrip(".") for n in names if n.strip()}
        self.any = "*" in cleaned
        self.suffixes = tuple(n[1:] for n in cleaned if n.startswith("*."))
        self.names = frozenset(host_name(n.encode()) for n in cleaned if not n.startswith("*")) | LOOPBACK_NAMES

    def allows(self, name: str) -> bool:
        return (
            self.any
            or name in self.names
            or name.endswith(".localhost")
            or is_ip_address(name)
            or name.endswith(self.suffixes)
        )


def _header(scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers") or [] if k == name), None)


def content_type_error(scope) -> APIError | None:
    """An API POST with a body that is not `application/json` (parameters such as charset are
    fine), in OpenAI's words. A POST with no body needs no content type (`/cancel`)."""
    value = _header(scope, b"content-type")
    if value is None:
        length = _header(scope, b"content-length")
        if _header(scope, b"transfer-encoding") is None and (length is None or length.strip() == b"0"):
            return None
        return APIError(
            "Missing Content-Type header. This API method only accepts 'application/json' requests. "
            "Please try again with a supported content type.",
            code="unsupported_content_type",
        )
    text = value.decode("latin-1")
    if text.partition(";")[0].strip().lower() == "application/json":
        return None
    shown = text if len(text) <= 100 else text[:100] + "..."
    return APIError(
        f"Unsupported content type: '{shown}'. This API method only accepts 'application/json' requests, "
        f"but you specified the header 'Content-Type: {shown}'. Please try again with a supported "
        "content type.",
        code="unsupported_content_type",
    )


class CrossSiteGuard:
    """Pure ASGI middleware: the Host check on every request, the content type on API POSTs."""

    def __init__(self, app, allowed_hosts: list[str]):
        self.app = app
        self.hosts = AllowedHosts(allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = _header(scope, b"host")
        error = None
        if host is not None and not self.hosts.allows(host_name(host)):
            shown = host.decode("latin-1")[:100]
            error = APIError(
                f"Invalid Host header '{shown}': this server answers for localhost, its IP addresses "
                "and the names it is started with (oss-agent serve --allowed-host NAME).",
                code="invalid_host",
            )
        elif scope["method"] == "POST" and api_path(scope["path"]).startswith("/v1/"):
            error = content_type_error(scope)
        if error is None:
            return await self.app(scope, receive, send)
        return await error.response()(scope, receive, send)
