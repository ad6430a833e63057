"""`--api-key`: every endpoint but /health wants `Authorization: Bearer <key>`.

A pure ASGI middleware (it must not buffer streams), comparing keys in constant time.
"""

from __future__ import annotations

import hmac

from .errors import APIError

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            error = APIError("Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                             status=401, code="invalid_api_key")
            return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)
