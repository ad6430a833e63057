"""Request body of Chat Completions (`POST /v1/chat/completions`), validated at the HTTP edge.

Every parameter of the `openai` SDK's `CompletionCreateParams` is accepted, or refused with the
reason (`schemas.responses.refused`): tests/agent_server/responses/test_request_surface.py walks them all.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from schemas.responses import (
    HARMONY_EFFORT,
    Identifier,
    Metadata,
    ReasoningEffort,
    StrictModel,
    check_json_schema,
    refused,
)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # this server caches every prefix by itself


RefusedImage = refused("RefusedImage", ("image_url",), "content parts", "gpt-oss reads text only")
RefusedAudio = refused("RefusedAudio", ("input_audio",), "content parts", "gpt-oss reads text only")
RefusedFile = refused(
    "RefusedFile",
    ("file",),
    "content parts",
    "gpt-oss reads text only, and this server keeps no files; send the text as a text part",
)
UserPart = Annotated[Union[TextPart, RefusedImage, RefusedAudio, RefusedFile], Field(discriminator="type")]


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


def _text_of(content: Union[str, list[Any], None]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in content)


class SystemMessage(StrictModel):
    role: Literal["system", "developer"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def text(self) -> str:
        return _text_of(self.content)


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Union[str, list[UserPart]]
    name: str | None = None

    def text(self) -> str:
        return _text_of(self.content)


class FunctionCall(StrictModel):
    name: str
    arguments: str
    parsed_arguments: Any = None  # what the SDK's `.parse()` adds: sent back as it came, ignored


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class CustomCall(StrictModel):
    name: str
    input: str


class CustomToolCall(StrictModel):
    id: str
    type: Literal["custom"]
    custom: CustomCall


class NoFunctionCall(BaseModel):
    """The deprecated `function_call` of an assistant message: refused (use tool_calls)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self) -> Any:
        raise PydanticCustomError(
            "unsupported_value", "'function_call' is deprecated and not supported; use 'tool_calls'"
        )


class NoAudio(BaseModel):
    """An audio reply referred to by id: refused, gpt-oss writes text only."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self) -> Any:
        raise PydanticCustomError("unsupported_value", "audio replies are not supported: gpt-oss writes text only")


class AssistantMessage(StrictModel):
    role: Literal["assistant"]
    content: Union[str, list[Annotated[Union[TextPart, RefusalPart], Field(discriminator="type")]], None] = None
    tool_calls: list[Annotated[Union[ToolCall, CustomToolCall], Field(discriminator="type")]] | None = None
    # The analysis channel of an earlier turn, as this server (and other gpt-oss servers) return it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    name: str | None = None
    # Fields of the SDK's assistant message that clients send back as they got them (`.parse()`
    # adds `parsed`): accepted and ignored, a deprecated `function_call` or an audio reply as null.
    annotations: list[dict[str, Any]] | None = None
    parsed: Any = None
    function_call: NoFunctionCall | None = None
    audio: NoAudio | None = None

    def text(self) -> str:
        return _text_of(self.content)


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Union[str, list[TextPart]]
    tool_call_id: str

    def text(self) -> str:
        return _text_of(self.content)


class FunctionMessage(BaseModel):
    """A reply to a deprecated `function_call`: refused (use tool messages)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["function"]

    @model_validator(mode="after")
    def _refuse(self) -> Any:
        raise PydanticCustomError(
            "unsupported_value", "'function' messages are deprecated and not supported; use 'tool' messages"
        )


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return "system" if role == "developer" else role


ChatMessage = Annotated[
    Union[
        Annotated[SystemMessage, Tag("system")],
        Annotated[UserMessage, Tag("user")],
        Annotated[AssistantMessage, Tag("assistant")],
        Annotated[ToolMessage, Tag("tool")],
        Annotated[FunctionMessage, Tag("function")],
    ],
    Discriminator(_role),
]


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_parameters(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value, info)


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class CustomTextFormat(StrictModel):
    type: Literal["text"]


class Grammar(StrictModel):
    syntax: Literal["lark", "regex"]
    definition: str


class CustomGrammarFormat(StrictModel):
    type: Literal["grammar"]
    grammar: Grammar


class CustomDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    format: Annotated[Union[CustomTextFormat, CustomGrammarFormat], Field(discriminator="type")] | None = None


class ChatCustomTool(StrictModel):
    """A tool whose input is freeform text (optionally following a grammar), not JSON."""

    type: Literal["custom"]
    custom: CustomDefinition


AnyChatTool = Annotated[Union[ChatTool, ChatCustomTool], Field(discriminator="type")]


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomChoice(StrictModel):
    type: Literal["custom"]
    custom: NamedFunction


class AllowedTools(StrictModel):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class AllowedToolsChoice(StrictModel):
    """Only these of `tools` may be called; `mode` "required": one of them must be."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Union[
    Literal["none", "auto", "required"],
    Annotated[Union[NamedToolChoice, NamedCustomChoice, AllowedToolsChoice], Field(discriminator="type")],
]


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class ResponseFormatText(StrictModel):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    # Optional in OpenAI's Chat Completions (unlike the Responses API's text.format).
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value, info)


class ResponseFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema], Field(discriminator="type")
]


class ChatCompletionRequest(StrictModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[AnyChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    # How long the answer should be: said to the model in the developer message (docs/api.md).
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: Identifier | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: Identifier | None = None
    prompt_cache_key: Identifier | None = None
    # Accepted as in OpenAI; this server caches prompt prefixes by itself, in memory.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Not OpenAI's: keep generating past the end of the turn (<|return|>, <|call|>) until the token
    # limit, for benchmarks that need exact output lengths. vLLM and SGLang take the same field.
    ignore_eos: bool = False

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value and "audio" in value:
            raise PydanticCustomError("unsupported_value", "'audio' output is not supported: gpt-oss writes text only")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Union[str, list[str], None]) -> Union[str, list[str], None]:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²" and "１" are digits to isdigit, not to int()
                raise ValueError(f"key {key!r} is not a token id")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias {bias} for token {key} is outside [-100, 100]")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def effort(self) -> str:
        """The Harmony reasoning effort: what was asked, mapped onto gpt-oss's three levels."""
        return HARMONY_EFFORT[self.reasoning_effort or "medium"]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
