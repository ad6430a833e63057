"""API keys, and whose responses a key may see. The WebSocket handshake of `/v1/responses` is checked the same way (a
refused one gets the 401 as its HTTP response).

`--api-key KEY` and `--api-keys-file PATH` (one key a line, `name:key` to name it): every
endpoint but /health then wants `Authorization: Bearer <key>`. A pure ASGI middleware (it must
not buffer streams). Keys are compared with `hmac.compare_digest` on their SHA-256 digests, each
key every time, so the time taken says nothing about a key, not even its length. The
playground page (`/`) and its static files are public: they hold no data, and every API call
the page makes needs a key like any other client's.

Each key has an owner name (its name in the keys file, `default` for --api-key, and for a key
given without a name one made from its digest), set on the request for the routes
(`request_owner`); ownership.py says what an owner may see.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from starlette.requests import HTTPConnection

from agent_server.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/"})
PUBLIC_PREFIXES = ("/static/",)
OWNER = "owner"  # the key in the ASGI scope's "state" (request.state.owner)
DEFAULT_OWNER = "default"  # --api-key's
NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def anonymous_owner(key: str) -> str:
    """The owner name of a key given without one: stable, and saying nothing of the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def read_keys_file(path: Path) -> dict[str, str]:
    """key -> owner name, from a file of `name:key` or `key` lines (blank lines and `#` comments
    skipped). ValueError naming the line for a bad one."""
    keys: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        if not sep:
            name, key = "", line
        elif not NAME.match(name):
            raise ValueError(f"{path}:{number}: a name is 1 to 64 letters, digits or _.@- (before the ':')")
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"{path}:{number}: the key is empty or holds white space")
        owner = name or anonymous_owner(key)
        if keys.get(key, owner) != owner:
            raise ValueError(f"{path}:{number}: this key is given twice, under two names")
        keys[key] = owner
    if not keys:
        raise ValueError(f"{path}: no keys in it")
    return keys


def request_owner(request: HTTPConnection) -> str | None:
    """The owner name of the request's (or WebSocket connection's) key; None when the server
    wants no key."""
    return request.scope.get("state", {}).get(OWNER)


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str | None = None, api_keys: dict[str, str] | None = None):
        self.app = app
        keys = dict(api_keys or {})
        if api_key:
            keys[api_key] = DEFAULT_OWNER
        self.keys = [(_digest(key.encode()), owner) for key, owner in keys.items()]

    def is_public(self, path: str) -> bool:
        return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)

    def owner(self, token: bytes) -> str | None:
        digest, found = _digest(token), None
        for expected, owner in self.keys:  # every key, every time
            if hmac.compare_digest(digest, expected):
                found = owner
        return found

    async def __call__(self, scope, receive, send) -> None:
        if not self.keys or scope["type"] not in ("http", "websocket") or self.is_public(scope["path"]):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), b"")
        scheme, _, token = header.strip().partition(b" ")
        owner = self.owner(token.strip()) if header and scheme.lower() == b"bearer" else None
        if not header:
            error = APIError(
                "Missing API key: send it in an 'Authorization: Bearer <key>' header.",
                status=401,
                code="invalid_api_key",
            )
        elif owner is None:
            error = APIError(
                "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                status=401,
                code="invalid_api_key",
            )
        else:
            scope.setdefault("state", {})[OWNER] = owner
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await error.refuse_websocket(scope, receive, send, {"www-authenticate": "Bearer"})
        response = error.response()
        response.headers["www-authenticate"] = "Bearer"
        return await response(scope, receive, send)
