"""Request bodies: JSON in, a validated pydantic model out, or an OpenAI-style 4xx.

Before the schema sees a body it must be at most `max_bytes` long (read in chunks, so a huge
upload is refused without being buffered), parse as a JSON object, nest at most
`MAX_JSON_DEPTH` levels, hold only encodable text (no lone surrogates from `\\ud800` escapes),
finite numbers (`1e400` parses as infinity) and integers that fit 64 bits, hold no text that
would take long to tokenize (`tokenization_cost`), not exceed the per-field array limits, and
not use a parameter this server knows but does not support (named, with the reason). An
explicit null stands for a parameter not given (`without_null_defaults`).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from agent_server.errors import APIError, from_validation_error
from agent_server.tokenization_cost import MAX_TOKENIZATION_COST, MIN_RUN, tokenization_cost
from schemas.responses import MAX_REQUEST_SCHEMA_BYTES, SCHEMA_BUDGET

Model = TypeVar("Model", bound=BaseModel)

MAX_JSON_DEPTH = 100
INT64 = 1 << 63


def too_large(max_bytes: int) -> APIError:
    return APIError(f"Request body is larger than {max_bytes} bytes.", status=413, code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, or a 413 as soon as it is known to be longer than `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody is left to answer; not a server error worth a traceback
        raise APIError("The client disconnected before sending the whole body.", code="client_disconnected") from None
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(
            f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.", code="invalid_json"
        ) from None
    except ValueError:  # bad JSON, bad UTF-8, NaN/Infinity, an integer too long to convert
        raise APIError(
            "We could not parse the JSON body of your request. The body must be a JSON object.", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.", code="invalid_json")
    check_json_values(body)
    return body


def _param(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def check_json_values(body: Any) -> None:
    """Depth, text and number checks over a parsed body, without recursion."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    long_texts: list[tuple[str, tuple]] = []
    text_bytes = 0
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise APIError(
                f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.",
                param=_param(path[:1]) or None,
                code="invalid_json",
            )
        if isinstance(value, str):
            text_bytes += _check_text(value, path)
            if len(value) >= MIN_RUN:
                long_texts.append((value, path))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            if not -INT64 <= value < INT64:
                raise APIError(
                    f"Invalid value for '{_param(path)}': integer out of the 64-bit range.",
                    param=_param(path),
                    code="invalid_value",
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise APIError(
                    f"Invalid value for '{_param(path)}': number out of the 64-bit floating-point range.",
                    param=_param(path),
                    code="invalid_value",
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                text_bytes += _check_text(key, path)
                if len(key) >= MIN_RUN:  # keys reach the prompt too (a function's parameter names)
                    long_texts.append((key, path))
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
    if text_bytes**2 > MAX_TOKENIZATION_COST:  # (otherwise no runs can cost more)
        _check_tokenization_cost(long_texts)


def _check_tokenization_cost(texts: list[tuple[str, tuple]]) -> None:
    cost = 0
    for text, path in texts:
        cost += tokenization_cost(text)
        if cost > MAX_TOKENIZATION_COST:
            raise APIError(
                f"Invalid value for '{_param(path)}': the request's text holds long runs of letters, "
                "punctuation or white space with no word boundary in them. Tokenizing such a run takes "
                "time that grows with the square of its length, so this server takes runs of about "
                f"{math.isqrt(MAX_TOKENIZATION_COST)} bytes in all.",
                param=_param(path) or None,
                code="invalid_value",
            )


def _check_text(text: str, path: tuple) -> int:
    """The text's length in UTF-8 bytes, once it is known to encode."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        param = _param(path) or None
        where = f" in '{param}'" if param else ""
        raise APIError(
            f"Invalid Unicode{where}: the text holds an unpaired surrogate (a lone \\ud800-\\udfff escape).",
            param=param,
            code="invalid_value",
        ) from None


def without_null_defaults(
    body: dict[str, Any], schema: type[BaseModel], unsupported: Mapping[str, str]
) -> dict[str, Any]:
    """An explicit null means "not given": the OpenAI SDKs send None as null for the parameters
    they type Optional, and so do proxies and other clients. Those nulls are dropped for the
    parameters refused as unsupported and for those whose default is not null (`store`,
    `stream`, `n`), which then take their default instead of failing their type check."""
    fields = schema.model_fields

    def not_given(key: str) -> bool:
        field = fields.get(key)
        return key in unsupported or (
            field is not None and not field.is_required() and field.get_default(call_default_factory=True) is not None
        )

    return {key: value for key, value in body.items() if value is not None or not not_given(key)}


def check_limits(body: Mapping[str, Any], max_items: Mapping[str, int], unsupported: Mapping[str, str]) -> None:
    for name, reason in unsupported.items():
        if name in body:
            raise APIError(
                f"Unsupported parameter: '{name}' is not supported by this server: {reason}.",
                param=name,
                code="unsupported_parameter",
            )
    for name, most in max_items.items():
        value = body.get(name)
        if isinstance(value, list) and len(value) > most:
            raise APIError(
                f"Invalid '{name}': {len(value)} items is too many; at most {most} are allowed.",
                param=name,
                code="array_above_max_length",
            )


async def read_request(
    request: Request,
    schema: type[Model],
    max_bytes: int,
    *,
    max_items: Mapping[str, int] | None = None,
    unsupported: Mapping[str, str] | None = None,
) -> Model:
    """`max_items`: top-level array parameter -> most items; `unsupported`: parameter -> why."""
    body = parse_json_object(await read_body(request, max_bytes))
    return validate_body(body, schema, max_items=max_items, unsupported=unsupported)


def validate_body(
    body: dict[str, Any],
    schema: type[Model],
    *,
    max_items: Mapping[str, int] | None = None,
    unsupported: Mapping[str, str] | None = None,
) -> Model:
    """A parsed body checked as `read_request` checks it, past the JSON-level checks."""
    body = without_null_defaults(body, schema, unsupported or {})
    check_limits(body, max_items or {}, unsupported or {})
    try:
        # Strict, as OpenAI is: "10" is not an integer and "yes" not a boolean. The context
        # bounds the time its JSON Schema checks take (`check_json_schema`).
        return schema.model_validate(body, strict=True, context={SCHEMA_BUDGET: MAX_REQUEST_SCHEMA_BYTES})
    except ValidationError as e:
        raise from_validation_error(e, body) from None


def int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    """A query parameter that is an integer in [low, high], or `default` when not given."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(f"Invalid value for '{name}': expected an integer.", param=name, code="invalid_type") from None
    if not low <= value <= high:
        raise APIError(
            f"Invalid value for '{name}': must be between {low} and {high}.", param=name, code="invalid_value"
        )
    return value
