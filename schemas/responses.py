"""Request bodies of the Responses API (`POST /v1/responses`), validated at the HTTP edge.

What the server sends back is built from the `openai` SDK's own types; only what clients send
is modelled here: every parameter, tool, item and content type of the SDK's
`ResponseCreateParams` (tests/agent_server/responses/test_request_surface.py walks them). Unknown fields are
rejected (OpenAI answers "Unknown parameter"); what gpt-oss or this server cannot do (images,
files, hosted tools it has none of) is refused by `refused()` with an `unsupported_value`
error naming the part and saying why.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# What clients may ask for; gpt-oss has three levels, which the others map onto (`effort`).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
HARMONY_EFFORT = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}
# What `include` can ask for. Those naming items this server never makes (file search, images)
# are accepted and have nothing to add, as in OpenAI when no such item is in the output.
Includable = Literal[
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
    "code_interpreter_call.outputs",
    "message.output_text.logprobs",
    "file_search_call.results",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Refused(BaseModel):
    """A kind of tool, item or content part that OpenAI accepts and this server cannot honour:
    it fails validation with the reason, whatever else it carries. Made by `refused()`."""

    model_config = ConfigDict(extra="allow")
    what: ClassVar[str] = ""
    reason: ClassVar[str] = ""
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> "Refused":
        raise PydanticCustomError(
            "unsupported_value",
            "'{kind}' {what} are not supported: {reason}",
            {"kind": self.type, "what": self.what, "reason": self.reason},
        )


def refused(name: str, kinds: tuple[str, ...], what: str, reason: str) -> type[Refused]:
    """A `Refused` model for the `type` values `kinds` ("tools", "input items", ...)."""
    return type(name, (Refused,), {"__annotations__": {"type": Literal[kinds]}, "what": what, "reason": reason})


class CallerDirect(StrictModel):
    type: Literal["direct"]


class CallerProgram(StrictModel):
    type: Literal["program"]
    caller_id: str


# Who made a call: the model directly, or a program of programmatic tool calling (which this
# server never runs, so no call of its own has one).
Caller = Annotated[Union[CallerDirect, CallerProgram], Field(discriminator="type")]


# --- input content parts -------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str
    # Where an explicit prompt cache entry ends: this server caches every prefix by itself.
    prompt_cache_breakpoint: dict[str, Any] | None = None


RefusedImage = refused("RefusedImage", ("input_image",), "inputs", "gpt-oss reads text only")
RefusedFile = refused(
    "RefusedFile",
    ("input_file",),
    "inputs",
    "gpt-oss reads text only, and this server keeps no files; send the text as input_text",
)
RefusedAudio = refused("RefusedAudio", ("input_audio",), "inputs", "gpt-oss reads text only")


class OutputTextPart(BaseModel):
    """Assistant text sent back as input; annotations and logprobs are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["output_text"]
    text: str


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    Union[InputText, OutputTextPart, RefusalPart, RefusedImage, RefusedFile, RefusedAudio],
    Field(discriminator="type"),
]


def _text_of(parts: Union[str, list[Any]]) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in parts)


# --- input items ----------------------------------------------------------------------------


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return _text_of(self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    namespace: str | None = None
    status: ItemStatus | None = None
    caller: Caller | None = None
    async_: bool | None = Field(default=None, alias="async")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str | None = None  # optional in OpenAI's schema; the output of no call is refused later
    output: Union[str, list[ContentPart]]
    id: str | None = None
    status: ItemStatus | None = None
    caller: Caller | None = None
    name: str | None = None
    namespace: str | None = None

    def text(self) -> str:
        return _text_of(self.output)


class CustomToolCallItem(StrictModel):
    """A call of a `custom` tool: freeform text input rather than JSON arguments."""

    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str
    id: str | None = None
    namespace: str | None = None
    caller: Caller | None = None
    async_: bool | None = Field(default=None, alias="async")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class CustomToolCallOutputItem(StrictModel):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: str | None = None
    caller: Caller | None = None

    def text(self) -> str:
        return _text_of(self.output)


class LocalShellAction(StrictModel):
    type: Literal["exec"]
    command: list[str]
    env: dict[str, str]
    timeout_ms: int | None = None
    user: str | None = None
    working_directory: str | None = None


class LocalShellCallItem(StrictModel):
    type: Literal["local_shell_call"]
    id: str
    call_id: str = Field(min_length=1)
    action: LocalShellAction
    status: ItemStatus


class LocalShellCallOutputItem(StrictModel):
    """The output of a local shell call; its `id` is the call's id, as OpenAI defines it."""

    type: Literal["local_shell_call_output"]
    id: str
    output: str
    status: ItemStatus | None = None


class ToolSearchCallItem(StrictModel):
    type: Literal["tool_search_call"]
    arguments: Any
    id: str | None = None
    call_id: str | None = None
    execution: Literal["server", "client"] | None = None
    status: ItemStatus | None = None


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
    status: ItemStatus | None = None


class LenientItem(BaseModel):
    """Output items of ours sent back as input (web search, code interpreter, MCP calls): the
    fields the server replays are typed (below), the rest pass through unchecked."""

    model_config = ConfigDict(extra="allow")
    type: Literal["web_search_call", "code_interpreter_call", "mcp_call", "mcp_list_tools", "tool_search_output"]
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

    type: Literal["item_reference"] | None = "item_reference"
    id: str = Field(min_length=1)


class ConfigurationUpdateItem(StrictModel):
    """Settings that change from here on in the conversation: the reasoning effort, the format."""

    type: Literal["configuration_update"]
    id: str | None = None
    reasoning: "ConfigurationReasoning | None" = None
    text: "ConfigurationText | None" = None


class AdditionalToolsItem(StrictModel):
    """Tools made available from this point of the input on (each request sees them all)."""

    type: Literal["additional_tools"]
    role: Literal["developer"]
    tools: list["Tool"]
    id: str | None = None


class ToolSearchOutputItem(LenientItem):
    """What a tool search found: those tools are available from then on."""

    type: Literal["tool_search_output"]
    tools: list["Tool"]
    call_id: str | None = None
    execution: Literal["server", "client"] | None = None
    status: ItemStatus | None = None

    model_config = ConfigDict(extra="forbid")


class CompactionItem(StrictModel):
    """A compaction item of this server (`POST /v1/responses/compact`, or a response that
    compacted by `context_management`), sent back as input: it stands for the conversation it
    summarises, whose summary it carries sealed."""

    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = None
    created_by: str | None = None


NO_COMPACTION_TRIGGER = (
    "compact with POST /v1/responses/compact, or set context_management's compact_threshold on the request"
)
NO_PROGRAMS = "this server does not run programmatic tool calling; call the tools directly"
RefusedItem = refused(
    "RefusedItem",
    (
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
    ),
    "input items",
    "this server has no file search, computer use or image generation tool (gpt-oss reads and writes text only)",
)
RefusedCompaction = refused("RefusedCompaction", ("compaction_trigger",), "input items", NO_COMPACTION_TRIGGER)
RefusedProgram = refused("RefusedProgram", ("program", "program_output"), "input items", NO_PROGRAMS)
RefusedApproval = refused(
    "RefusedApproval",
    ("mcp_approval_request", "mcp_approval_response"),
    "input items",
    "MCP tool approvals are not supported; use require_approval='never'",
)
RefusedClientTool = refused(
    "RefusedClientTool",
    ("shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output"),
    "input items",
    "the 'shell' and 'apply_patch' tools are not served here; give the model function or custom tools that do the same",
)


def _item_kind(value: Any) -> str:
    """The item's `type`; without one a message (it has a role) or an item reference."""
    get = value.get if isinstance(value, dict) else lambda key, default=None: getattr(value, key, default)
    kind = get("type")
    if kind is not None:
        return kind
    return "message" if get("role") is not None or get("id") is None else "item_reference"


_REFUSED_ITEMS = tuple(
    Annotated[model, Tag(kind)]
    for model in (RefusedItem, RefusedCompaction, RefusedProgram, RefusedApproval, RefusedClientTool)
    for kind in model.model_fields["type"].annotation.__args__
)
InputItem = Annotated[
    Union[
        (
            Annotated[MessageItem, Tag("message")],
            Annotated[FunctionCallItem, Tag("function_call")],
            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
            Annotated[ReasoningItem, Tag("reasoning")],
            Annotated[LenientItem, Tag("web_search_call")],
            Annotated[CodeInterpreterCallItem, Tag("code_interpreter_call")],
            Annotated[McpCallItem, Tag("mcp_call")],
            Annotated[LenientItem, Tag("mcp_list_tools")],
            Annotated[ItemReference, Tag("item_reference")],
            Annotated[CustomToolCallItem, Tag("custom_tool_call")],
            Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
            Annotated[LocalShellCallItem, Tag("local_shell_call")],
            Annotated[LocalShellCallOutputItem, Tag("local_shell_call_output")],
            Annotated[ToolSearchCallItem, Tag("tool_search_call")],
            Annotated[ToolSearchOutputItem, Tag("tool_search_output")],
            Annotated[AdditionalToolsItem, Tag("additional_tools")],
            Annotated[ConfigurationUpdateItem, Tag("configuration_update")],
            Annotated[CompactionItem, Tag("compaction")],
            *_REFUSED_ITEMS,
        )
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
            raise ValueError(
                f"the request's schemas are more than {MAX_REQUEST_SCHEMA_BYTES} bytes of JSON in all "
                "(function parameters and response format)"
            )
    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as e:
        raise ValueError(f"not a valid JSON Schema: {e.message}") from None
    return value


Callers = list[Literal["direct", "programmatic"]]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Loaded only once a tool search finds it, in OpenAI. gpt-oss is shown every tool up front,
    # so a deferred tool is described like the others (docs/api.md).
    defer_loading: bool | None = None
    allowed_callers: Callers | None = None
    output_schema: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("parameters")
    @classmethod
    def _valid_parameters(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value, info)


class CustomTextFormat(StrictModel):
    type: Literal["text"]


class CustomGrammarFormat(StrictModel):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str


class CustomTool(StrictModel):
    """A tool whose input is freeform text (optionally following a grammar), not JSON."""

    type: Literal["custom"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    format: Annotated[Union[CustomTextFormat, CustomGrammarFormat], Field(discriminator="type")] | None = None
    defer_loading: bool | None = None
    allowed_callers: Callers | None = None
    async_: bool | None = Field(default=None, alias="async")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class NamespaceTool(StrictModel):
    """Tools grouped under a name: a Harmony tool namespace of their own (`name.tool`)."""

    type: Literal["namespace"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str
    tools: list[Annotated[Union[FunctionTool, CustomTool], Field(discriminator="type")]] = Field(min_length=1)


class LocalShellTool(StrictModel):
    """A shell the client runs: the model calls it with a command, the client answers."""

    type: Literal["local_shell"]


class ToolSearchTool(StrictModel):
    """Tool search over deferred tools. gpt-oss sees every tool up front, so there is nothing to
    search: accepted, not shown to the model (docs/api.md)."""

    type: Literal["tool_search"]
    description: str | None = None
    execution: Literal["server", "client"] | None = None
    parameters: Any = None


class UserLocation(StrictModel):
    # Optional in the request, as the SDK's web_search tool has it, but always echoed: the
    # web_search_preview tool of a response requires it.
    type: Literal["approximate"] | None = "approximate"
    city: str | None = None
    country: str | None = None
    region: str | None = None
    timezone: str | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _approximate(cls, value: Any) -> Any:
        return "approximate" if value is None else value


class WebSearchFilters(StrictModel):
    allowed_domains: list[str] | None = None


WEB_SEARCH_TYPES = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11")


class WebSearchTool(StrictModel):
    type: Literal[WEB_SEARCH_TYPES]
    search_context_size: Literal["low", "medium", "high"] | None = None
    user_location: UserLocation | None = None
    filters: WebSearchFilters | None = None
    # False: no live fetches, the server's local search backend only.
    external_web_access: bool | None = None
    search_content_types: list[Literal["text", "image"]] | None = None


class ContainerAuto(StrictModel):
    type: Literal["auto"]
    file_ids: list[str] | None = None
    memory_limit: Literal["1g", "4g", "16g", "64g"] | None = None
    # Accepted as in OpenAI: the sandbox has no network either way (SECURITY.md).
    network_policy: dict[str, Any] | None = None


class CodeInterpreterTool(StrictModel):
    type: Literal["code_interpreter"]
    container: Union[str, ContainerAuto] = "auto"
    allowed_callers: Callers | None = None


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
    authorization: str | None = None
    connector_id: str | None = None
    tunnel_id: str | None = None
    defer_loading: bool | None = None
    allowed_callers: Callers | None = None


RefusedTool = refused(
    "RefusedTool",
    (
        "file_search",
        "computer",
        "computer_use_preview",
        "image_generation",
    ),
    "tools",
    "this server has no vector stores, computer use or image generation (gpt-oss reads and writes text only)",
)
RefusedProgramTool = refused("RefusedProgramTool", ("programmatic_tool_calling",), "tools", NO_PROGRAMS)
RefusedClientToolKind = refused(
    "RefusedClientToolKind",
    ("shell", "apply_patch"),
    "tools",
    "give the model function or custom tools that do the same",
)

Tool = Annotated[
    Union[
        FunctionTool,
        WebSearchTool,
        CodeInterpreterTool,
        McpTool,
        CustomTool,
        NamespaceTool,
        LocalShellTool,
        ToolSearchTool,
        RefusedTool,
        RefusedProgramTool,
        RefusedClientToolKind,
    ],
    Field(discriminator="type"),
]


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


class ToolChoiceCustom(StrictModel):
    type: Literal["custom"]
    name: str


class ToolChoiceBuiltin(StrictModel):
    type: Literal["web_search_preview", "web_search_preview_2025_03_11", "web_search", "code_interpreter"]


class ToolChoiceMcp(StrictModel):
    type: Literal["mcp"]
    server_label: str
    name: str | None = None


class ToolChoiceAllowed(StrictModel):
    """Only these of `tools` may be used; `mode` "required": one of them must be."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


RefusedChoice = refused(
    "RefusedChoice",
    (
        "file_search",
        "computer",
        "computer_use_preview",
        "image_generation",
        "computer_use",
        "programmatic_tool_calling",
        "apply_patch",
        "shell",
    ),
    "tool choices",
    "this server has no such tool",
)

ToolChoice = Union[
    Literal["none", "auto", "required"],
    Annotated[
        Union[ToolChoiceFunction, ToolChoiceCustom, ToolChoiceBuiltin, ToolChoiceMcp, ToolChoiceAllowed, RefusedChoice],
        Field(discriminator="type"),
    ],
]


# --- other options --------------------------------------------------------------------------


# Strings the server echoes and stores, bounded as OpenAI bounds them: metadata is at most 16
# pairs, keys up to 64 characters and values up to 512; `user`, `safety_identifier` and
# `prompt_cache_key` up to 64 characters.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]
Identifier = Annotated[str, Field(max_length=64)]


class ReasoningOptions(StrictModel):
    effort: ReasoningEffort | None = None
    # gpt-oss writes no summaries: its reasoning items carry the reasoning itself (docs/api.md).
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    # Which earlier turns' reasoning the model sees again (docs/api.md).
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class ConfigurationReasoning(StrictModel):
    effort: ReasoningEffort | None = None


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


class ConfigurationText(StrictModel):
    format: TextFormat


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None


class ContextManagement(StrictModel):
    """`compaction`: when the prompt passes `compact_threshold` tokens, the model first
    summarises the conversation into a compaction item, and the response runs on that."""

    type: str
    compact_threshold: int | None = Field(default=None, ge=1)

    @field_validator("type")
    @classmethod
    def _compaction_only(cls, value: str) -> str:
        if value != "compaction":
            raise PydanticCustomError(
                "unsupported_value",
                "'{kind}' context management is not supported: only 'compaction' is",
                {"kind": value},
            )
        return value


class ConversationReference(StrictModel):
    id: str = Field(min_length=1)


class PromptCacheOptions(StrictModel):
    """Accepted: this server caches every prompt prefix by itself, in memory."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    prewarm: bool | None = None
    comparison_response_id: str | None = None


class BackgroundOptions(StrictModel):
    completion_window: Literal["soonest", "2h", "8h"] | None = None
    continuation_id: str | None = None


class AccessPrograms(StrictModel):
    cyber: Literal["standard", "daybreak_blue", "daybreak_red"] | None = None


class ImageOptions(StrictModel):
    context_compression: Literal["auto", "enabled", "disabled"] | None = None


AdditionalToolsItem.model_rebuild()
ToolSearchOutputItem.model_rebuild()
ConfigurationUpdateItem.model_rebuild()


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on `metadata`: 16 keys of at most 64 characters, values of at most 512."""
    if value is None:
        return value
    if len(value) > 16:
        raise ValueError("at most 16 metadata keys are allowed")
    for key, text in value.items():
        if len(key) > 64:
            raise ValueError(f"metadata key {key[:20]!r}... is longer than 64 characters")
        if len(text) > 512:
            raise ValueError(f"metadata value for {key!r} is longer than 512 characters")
    return value


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
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Accepted as in OpenAI; this server caches prompt prefixes by itself (docs/api.md).
    prompt_cache_key: Identifier | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: Identifier | None = None
    context_management: list[ContextManagement] | None = None
    # A stored conversation (`/v1/conversations`): its items come before `input`, and this
    # response's input and output items are added to it.
    conversation: Union[str, ConversationReference, None] = None
    background_options: BackgroundOptions | None = None
    access_programs: AccessPrograms | None = None
    image: ImageOptions | None = None
    # Not in the SDK but accepted by OpenAI (Codex sends it): free-form data about the client.
    client_metadata: dict[str, Any] | None = None

    @property
    def effort(self) -> str:
        """The Harmony reasoning effort: what was asked, mapped onto gpt-oss's three levels."""
        asked = self.reasoning.effort if self.reasoning and self.reasoning.effort else "medium"
        return HARMONY_EFFORT[asked]

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationReference) else self.conversation

    @property
    def compact_threshold(self) -> int | None:
        """The prompt length past which the conversation is compacted first (`context_management`)."""
        thresholds = [c.compact_threshold for c in self.context_management or [] if c.compact_threshold is not None]
        return min(thresholds) if thresholds else None

    def input_items(self) -> list[Any]:
        """`input` as a list of items (a plain string is one user message)."""
        return input_item_list(self.input)


def input_item_list(value: Union[str, list[Any], None]) -> list[Any]:
    """An `input` as a list of items (a plain string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    return list(value)


class ResponseCompactRequest(StrictModel):
    """`POST /v1/responses/compact`: the conversation (`input`, after `previous_response_id`'s)
    to summarise into a compaction item."""

    model: str
    input: Union[str, list[InputItem], None] = None
    instructions: str | None = None
    previous_response_id: str | None = None
    # Accepted as on create (the engine caches prompt prefixes by itself).
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "fast", "flex", "priority"] | None = None
    image: ImageOptions | None = None


class InputTokensRequest(StrictModel):
    """`POST /v1/responses/input_tokens`: the parameters of a create request that shape its
    prompt, whose tokens are counted."""

    model: str | None = None  # optional here: the server's model
    input: Union[str, list[InputItem], None] = None
    instructions: str | None = None
    conversation: Union[str, ConversationReference, None] = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's model personalities: gpt-oss has none, so it changes nothing in the prompt.
    personality: str | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def create_request(self, model: str) -> ResponseCreateRequest:
        """The create request whose prompt this is (`model`: when the body names none)."""
        given = {
            name: getattr(self, name)
            for name in self.model_fields_set
            if name not in ("model", "personality") and getattr(self, name) is not None
        }
        return ResponseCreateRequest(model=self.model or model, **given)
