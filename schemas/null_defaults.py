"""An explicit `null` for a request parameter means "not given".

The OpenAI SDKs type most parameters `Optional` and send `None` as JSON `null`; so do proxies
and clients in other languages. A parameter with a non-null default (`store`, `stream`, `n`)
takes that default instead of failing its type check.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def drop_nulls_with_defaults(model: type[BaseModel], data: Any) -> Any:
    """A request body without the nulls of the fields whose default is not null."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields

    def has_default(key: str) -> bool:
        field = fields.get(key)
        return field is not None and not field.is_required() and field.get_default(call_default_factory=True) is not None

    return {key: value for key, value in data.items() if value is not None or not has_default(key)}
