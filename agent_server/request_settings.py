"""What a Responses request asks of the prompt besides its conversation.

The tools (the request's, then those `additional_tools` and `tool_search_output` items add,
narrowed by an `allowed_tools` choice), the reasoning effort and output format (a
`configuration_update` item changes them from there on: the last one wins), and the wishes
Harmony has no field for, said to the model as instructions: `text.verbosity`, a web search's
`user_location` and `filters.allowed_domains`. `reasoning.context: "all_turns"` keeps the
analysis of earlier turns in the prompt (gpt-oss drops it by default: "current_turn").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent_server.errors import APIError
from agent_server.harmony import verbosity_note
from schemas.responses import (
    HARMONY_EFFORT,
    WEB_SEARCH_TYPES,
    AdditionalToolsItem,
    ConfigurationUpdateItem,
    ResponseCreateRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    ToolChoiceAllowed,
    ToolSearchOutputItem,
    WebSearchTool,
)


@dataclass
class RequestSettings:
    tools: list[Any] = field(default_factory=list)
    effort: str = "medium"  # Harmony's
    response_format: dict[str, Any] | None = None
    text_format: Any = None  # the `text.format` in effect (the turn grammar enforces a strict one)
    notes: list[str] = field(default_factory=list)  # instructions for the model
    keep_analysis: bool = False


def request_settings(req: ResponseCreateRequest, items: list[Any]) -> RequestSettings:
    tools = list(req.tools)
    effort = req.effort
    fmt = req.text.format if req.text else None
    for item in items:
        if isinstance(item, (AdditionalToolsItem, ToolSearchOutputItem)):
            tools += item.tools
        elif isinstance(item, ConfigurationUpdateItem):
            if item.reasoning is not None and item.reasoning.effort is not None:
                effort = HARMONY_EFFORT[item.reasoning.effort]
            if item.text is not None:
                fmt = item.text.format
    if isinstance(req.tool_choice, ToolChoiceAllowed):
        tools = _allowed(tools, req.tool_choice)
    notes = [note for note in [verbosity_note(req.text.verbosity if req.text else None)] if note]
    for tool in tools:
        if isinstance(tool, WebSearchTool):
            notes += _web_search_notes(tool)
    context = req.reasoning.context if req.reasoning else None
    return RequestSettings(
        tools=tools,
        effort=effort,
        response_format=response_format(fmt),
        text_format=fmt,
        notes=notes,
        keep_analysis=context == "all_turns",
    )


def response_format(fmt: Any) -> dict[str, Any] | None:
    """`text.format` as the developer message's response format section, or None for text."""
    if isinstance(fmt, TextFormatJsonSchema):
        return {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description}
    if isinstance(fmt, TextFormatJsonObject):
        return {
            "name": "json_object",
            "schema": {"type": "object"},
            "description": "Answer with a single JSON object and nothing else.",
        }
    return None


def _kind(tool_type: str) -> str:
    return "web_search" if tool_type in WEB_SEARCH_TYPES else tool_type


def _allowed(tools: list[Any], choice: ToolChoiceAllowed) -> list[Any]:
    """The tools an `allowed_tools` choice keeps: each entry names a tool by type, and by name
    (function, custom, namespace) or server label (mcp) where it has one."""
    kept = []
    for i, entry in enumerate(choice.tools):
        kind = entry.get("type")
        matches = [
            t
            for t in tools
            if isinstance(kind, str)
            and _kind(t.type) == _kind(kind)
            and all(getattr(t, key, None) == entry[key] for key in ("name", "server_label") if key in entry)
        ]
        if not matches:
            raise APIError(f"Allowed tool {entry!r} is not one of 'tools'.", param=f"tool_choice.tools[{i}]")
        kept += [t for t in matches if not any(t is k for k in kept)]
    return [t for t in tools if any(t is k for k in kept)]


def _web_search_notes(tool: WebSearchTool) -> list[str]:
    notes = []
    where = tool.user_location
    if where is not None:
        place = ", ".join(p for p in (where.city, where.region, where.country) if p)
        if place or where.timezone:
            zone = f" (time zone {where.timezone})" if where.timezone else ""
            notes.append(f"The user is in {place or 'an unknown place'}{zone}; use that when searching.")
    domains = tool.filters.allowed_domains if tool.filters else None
    if domains:
        notes.append("Search and open pages of these domains only: " + ", ".join(domains) + ".")
    return notes
