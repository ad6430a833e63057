"""Request bodies: JSON in, a validated pydantic model out, or an OpenAI-style 4xx."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from .errors import APIError, from_validation_error

Model = TypeVar("Model", bound=BaseModel)


async def read_request(request: Request, schema: type[Model], max_bytes: int) -> Model:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(f"Request body is larger than {max_bytes} bytes.", status=413, code="request_too_large")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise APIError(f"Request body is larger than {max_bytes} bytes.", status=413, code="request_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("We could not parse the JSON body of your request. The body must be a JSON object.",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.", code="invalid_json")
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e, body) from None
