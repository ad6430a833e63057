"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Handlers raise `APIError`; the app turns it (and pydantic validation errors, via
`from_validation_error`) into that body. Nothing the client sends should surface as a 500.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse


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
    param = _param_path(tuple(error["loc"]), body, keep_last=kind in ("extra_forbidden", "missing"))
    if kind == "extra_forbidden":
        return APIError(f"Unknown parameter: '{param}'.", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    message = error["msg"].removeprefix("Value error, ")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return APIError(f"Invalid value for '{param}': {message}.", param=param or None, code=code)
