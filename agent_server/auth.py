"""`--api-key`: every endpoint but /health wants `Authorization: Bearer <key>`; so does the
WebSocket handshake of `/v1/responses` (a refused one gets the 401 as its HTTP response).

A pure ASGI middleware (it must not buffer streams). Keys are compared with
`hmac.compare_digest` on their SHA-256 digests, so the time taken says nothing about the key,
not even its length. The playground page (`/`) and its static files are public: they hold no
data, and every API call the page makes needs the key like any other client's.
"""

from __future__ import annotations

import hashlib
import hmac

from agent_server.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/"})
PUBLIC_PREFIXES = ("/static/",)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = _digest(api_key.encode()) if api_key else None

    def is_public(self, path: str) -> bool:
        return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)

    async def __call__(self, scope, receive, send) -> None:
        if self.expected is None or scope["type"] not in ("http", "websocket") or self.is_public(scope["path"]):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), b"")
        scheme, _, token = header.strip().partition(b" ")
        if not header:
            error = APIError("Missing API key: send it in an 'Authorization: Bearer <key>' header.",
                             status=401, code="invalid_api_key")
        elif scheme.lower() != b"bearer" or not hmac.compare_digest(_digest(token.strip()), self.expected):
            error = APIError("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                             status=401, code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await error.refuse_websocket(scope, receive, send, {"www-authenticate": "Bearer"})
        response = error.response()
        response.headers["www-authenticate"] = "Bearer"
        return await response(scope, receive, send)
