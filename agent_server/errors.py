"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Handlers raise `APIError`; the app turns it (and pydantic validation errors, via
`from_validation_error`) into that body. Nothing the client sends should surface as a 500.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from agent_server.request_ids import current_request_id

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    async def refuse_websocket(self, scope, receive, send, headers: dict[str, str] | None = None) -> None:
        """Refuse a WebSocket handshake with this error as an HTTP response (uvicorn sends it
        through the ASGI WebSocket denial response extension; without it, the close is bare)."""
        await receive()  # websocket.connect
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        response = self.response()
        response.headers.update(headers or {})
        await response(scope, receive, send)


def not_found(kind: str, ident: str, param: str | None = None) -> APIError:
    return APIError(f"{kind} with id '{ident}' not found.", status=404, param=param, code="not_found")


def _param_path(loc: tuple, body: Any, keep_last: bool) -> str:
    """Dotted OpenAI-style path (`input[0].content`) of an error location.

    pydantic puts union-branch labels (`str`, `list[...]`, discriminator tags) into `loc`; they
    are dropped by walking the request body and keeping only keys and indexes that exist in it.
    """
    parts: list[str] = []
    node = body
    for i, key in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(key, int) and isinstance(node, list) and 0 <= key < len(node):
            parts.append(f"[{key}]")
            node = node[key]
        elif isinstance(key, str) and isinstance(node, dict) and key in node:
            parts.append(f".{key}" if parts else key)
            node = node[key]
        elif last and keep_last and isinstance(key, str):
            parts.append(f".{key}" if parts else key)
    return "".join(parts)


def from_validation_error(exc: ValidationError, body: Any) -> APIError:
    """The most useful single error of a pydantic ValidationError, naming the parameter."""
    errors = exc.errors(include_url=False)
    order = {"extra_forbidden": 0, "missing": 1}
    # Unknown and missing parameters first; otherwise the deepest location (the branch of a
    # union that matched the input's shape says most).
    error = min(errors, key=lambda e: (order.get(e["type"], 2), -len(e["loc"])))
    kind = error["type"]
    loc = tuple(error["loc"])
    if kind == "unsupported_value" and loc and loc[-1] == (error.get("ctx") or {}).get("kind"):
        loc = loc[:-1]  # the union's tag of a refused item (a key of the body too, for some)
    param = _param_path(loc, body, keep_last=kind in ("extra_forbidden", "missing"))
    if kind == "extra_forbidden":
        return APIError(f"Unknown parameter: '{param}'.", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind in ("string_too_long", "too_long"):
        owner = _param_path(tuple(error["loc"][:-2]), body, keep_last=False)  # (of a property name)
        return _too_long(error, param, owner)
    message = error["msg"].removeprefix("Value error, ")
    if kind == "unsupported_value":  # (schemas.responses.Refused): OpenAI's, this server cannot do it
        return APIError(f"Unsupported value for '{param}': {message}.", param=param or None, code=kind)
    wrong_type = kind.endswith(("_type", "_parsing")) or kind in ("int_from_float", "model_attributes_type")
    code = "invalid_type" if wrong_type else "invalid_value"
    return APIError(f"Invalid value for '{param}': {message}.", param=param or None, code=code)


def _too_long(error: dict[str, Any], param: str, owner: str) -> APIError:
    """OpenAI's words for a string, an object or an array over its length limit (`owner`: the
    object, when it is one of its property names)."""
    value, most = error["input"], error["ctx"]["max_length"]
    if error["loc"][-1] == "[key]":  # a property name (pydantic's location of a dict key)
        shown = value if len(value) <= 100 else value[:100] + "..."
        return APIError(
            f"Invalid property name in '{owner}': '{shown}' is too long. Expected a string with maximum "
            f"length {most}, but got a string with length {len(value)} instead.",
            param=f"{owner}.{shown}",
            code="property_name_above_max_length",
        )
    if isinstance(value, str):
        return APIError(
            f"Invalid '{param}': string too long. Expected a string with maximum length {most}, but got a "
            f"string with length {len(value)} instead.",
            param=param,
            code="string_above_max_length",
        )
    if isinstance(value, dict):
        return APIError(
            f"Invalid '{param}': too many properties. Expected an object with at most {most} properties, "
            f"but got an object with {len(value)} properties instead.",
            param=param,
            code="object_above_max_properties",
        )
    return APIError(
        f"Invalid '{param}': array too long. Expected an array with maximum length {most}, but got an "
        f"array with length {len(value)} instead.",
        param=param,
        code="array_above_max_length",
    )


def internal_error() -> APIError:
    """The 500 for a bug: what went wrong is in the log (with this request id), not in the body."""
    request_id = current_request_id.get()
    reference = f" (request id {request_id})" if request_id else ""
    return APIError(
        f"The server had an error while processing your request{reference}.", status=500, code="server_error"
    )


def engine_unavailable(reason: str) -> APIError:
    """The 503 for a request the engine can no longer take (its process exited, or it is shut down)."""
    return APIError(f"The model engine is unavailable ({reason}); retry later.", status=503, code="engine_unavailable")


def shutting_down() -> APIError:
    return APIError(
        "The server is shutting down and could not finish this request; retry it.",
        status=503,
        code="server_shutting_down",
    )


class UnexpectedErrorMiddleware:
    """An exception no route handled becomes a 500 with an OpenAI-style body. Unlike Starlette's
    own last-resort handler it is not re-raised afterwards, so the connection stays usable.

    A request cancelled before it answered (uvicorn does that to requests still open when the
    shutdown grace period ends) gets a 503 instead of uvicorn's plain-text 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if started:
                raise
            # The request's own top-level task, which nothing awaits: answering ends it.
            await shutting_down().response()(scope, receive, send)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], repr(scope["path"])[1:-1])
            if started:  # too late for an error body: the server drops the connection
                raise
            await internal_error().response()(scope, receive, send)
