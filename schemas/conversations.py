"""Request bodies of the Conversations API (`/v1/conversations`), validated at the HTTP edge.

A conversation holds Responses API items; what may be added to one is what `input` takes
(`schemas.responses.InputItem`), at most `MAX_ITEMS_PER_REQUEST` at a time, as in OpenAI.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from schemas.responses import InputItem, StrictModel, check_metadata

MAX_ITEMS_PER_REQUEST = 20


class ConversationCreateRequest(StrictModel):
    items: list[InputItem] | None = Field(default=None, max_length=MAX_ITEMS_PER_REQUEST)
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)


class ConversationUpdateRequest(StrictModel):
    metadata: dict[str, str] | None  # required, as in OpenAI (null clears it)

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)


class ConversationItemsRequest(StrictModel):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)
