"""Request bodies of the Responses API (`POST /v1/responses`), validated at the HTTP edge.

What the server sends back is built from the `openai` SDK's own types; only what clients send
is modelled here. Unknown fields are rejected (OpenAI answers "Unknown parameter"), and inputs
gpt-oss cannot take (images, files, audio) fail validation with a message naming the part.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

ReasoningEffort = Literal["low", "medium", "high"]
# What `include` can ask for here ("reasoning.encrypted_content" is refused with a reason).
Includable = Literal[
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- input content parts -------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(BaseModel):
    """Assistant text sent back as input; annotations and logprobs are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["output_text"]
    text: str


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[Union[InputText, OutputTextPart, RefusalPart], Field(discriminator="type")]


# --- input items ----------------------------------------------------------------------------


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        # A clear message for inputs this text-only model cannot read.
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("input_image", "input_file", "input_audio"):
                    raise ValueError(f"'{kind}' content is not supported: gpt-oss reads text only")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    namespace: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in self.output)


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class LenientItem(BaseModel):
    """Output items of ours sent back as input (web search, code interpreter, MCP calls): the
    fields the server replays are typed (below), the rest pass through unchecked."""

    model_config = ConfigDict(extra="allow")
    type: Literal["web_search_call", "code_interpreter_call", "mcp_call", "mcp_list_tools"]
    id: str | None = None


class CodeInterpreterOutput(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    logs: str | None = None


class CodeInterpreterCallItem(LenientItem):
    type: Literal["code_interpreter_call"]
    code: str | None = None
    outputs: list[CodeInterpreterOutput] | None = None


class McpCallItem(LenientItem):
    type: Literal["mcp_call"]
    name: str | None = None
    server_label: str | None = None
    arguments: str | None = None
    output: str | None = None
    error: str | dict[str, Any] | None = None  # ours: {"type": "mcp_tool_execution_error", "content": ...}


class ItemReference(StrictModel):
    """An item of a stored response, by id: the server puts the item itself in its place."""

    type: Literal["item_reference"]
    id: str = Field(min_length=1)


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
        Annotated[LenientItem, Tag("web_search_call")],
        Annotated[CodeInterpreterCallItem, Tag("code_interpreter_call")],
        Annotated[McpCallItem, Tag("mcp_call")],
        Annotated[LenientItem, Tag("mcp_list_tools")],
        Annotated[ItemReference, Tag("item_reference")],
    ],
    Discriminator(_item_kind),
]


# --- tools ----------------------------------------------------------------------------------


MAX_SCHEMA_BYTES = 64 << 10  # jsonschema checks about 0.35 MB a second, on the event loop
# ... and all of a request's schemas together (function parameters, the response format): 128
# tools of 64 KB would hold the server for 20 s.
MAX_REQUEST_SCHEMA_BYTES = 256 << 10
SCHEMA_BUDGET = "schema_bytes_left"  # the validation context's key for what is left of that


def check_json_schema(value: dict[str, Any], info: ValidationInfo | None = None) -> dict[str, Any]:
    """Reject a `schema` that is not a JSON Schema (draft 2020-12 meta-schema), or is too large to
    check quickly: over MAX_SCHEMA_BYTES, or past what is left of the request's budget when
    the validation context holds one (`SCHEMA_BUDGET`, counted down here)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted")
    context = info.context if info is not None else None
    if context is not None and SCHEMA_BUDGET in context:
        context[SCHEMA_BUDGET] -= size
        if context[SCHEMA_BUDGET] < 0:
            raise ValueError(f"the request's schemas are more than {MAX_REQUEST_SCHEMA_BYTES} bytes of JSON in all "
                             "(function parameters and response format)")
    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as e:
        raise ValueError(f"not a valid JSON Schema: {e.message}") from None
    return value


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_parameters(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value, info)


class UserLocation(StrictModel):
    type: Literal["approximate"] = "approximate"
    city: str | None = None
    country: str | None = None
    region: str | None = None
    timezone: str | None = None


class WebSearchFilters(StrictModel):
    allowed_domains: list[str] | None = None


class WebSearchTool(StrictModel):
    type: Literal["web_search_preview", "web_search_preview_2025_03_11", "web_search"]
    search_context_size: Literal["low", "medium", "high"] | None = None
    user_location: UserLocation | None = None
    filters: WebSearchFilters | None = None


class ContainerAuto(StrictModel):
    type: Literal["auto"]
    file_ids: list[str] | None = None
    memory_limit: Literal["1g", "4g", "16g", "64g"] | None = None


class CodeInterpreterTool(StrictModel):
    type: Literal["code_interpreter"]
    container: Union[str, ContainerAuto] = "auto"


class McpToolFilter(StrictModel):
    """Which tools of an MCP server: by name, and (read_only) those it marks read-only."""

    read_only: bool | None = None
    tool_names: list[str] | None = None


class McpApprovalFilter(StrictModel):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpTool(StrictModel):
    type: Literal["mcp"]
    server_label: str
    server_url: str | None = None
    server_description: str | None = None
    allowed_tools: Union[list[str], McpToolFilter, None] = None
    require_approval: Union[Literal["always", "never"], McpApprovalFilter, None] = None
    headers: dict[str, str] | None = None


Tool = Annotated[Union[FunctionTool, WebSearchTool, CodeInterpreterTool, McpTool], Field(discriminator="type")]


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


class ToolChoiceBuiltin(StrictModel):
    type: Literal["web_search_preview", "web_search_preview_2025_03_11", "web_search", "code_interpreter"]


class ToolChoiceMcp(StrictModel):
    type: Literal["mcp"]
    server_label: str
    name: str | None = None


ToolChoice = Union[
    Literal["none", "auto", "required"],
    Annotated[Union[ToolChoiceFunction, ToolChoiceBuiltin, ToolChoiceMcp], Field(discriminator="type")],
]


# --- other options --------------------------------------------------------------------------


# Strings the server echoes and stores, bounded as OpenAI bounds them: metadata is at most 16
# pairs, keys up to 64 characters and values up to 512; `user`, `safety_identifier` and
# `prompt_cache_key` up to 64 characters.
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]
Identifier = Annotated[str, Field(max_length=64)]


class ReasoningOptions(StrictModel):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return check_json_schema(value, info)


TextFormat = Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema], Field(discriminator="type")]


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None


class ResponseCreateRequest(StrictModel):
    model: str
    input: Union[str, list[InputItem], None] = None
    instructions: str | None = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(default=None, ge=1)
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextOptions | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: Metadata | None = None
    user: Identifier | None = None
    include: list[Includable] | None = None
    # "disabled" (default): an input longer than the context gets a 400; "auto": the oldest items go.
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: Identifier | None = None
    safety_identifier: Identifier | None = None

    @property
    def effort(self) -> ReasoningEffort:
        return (self.reasoning.effort if self.reasoning and self.reasoning.effort else None) or "medium"

    def input_items(self) -> list[Any]:
        """`input` as a list of items (a plain string is one user message)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
