"""Tools the client runs, as the model sees them in Harmony and as its calls come back.

    function     -> `functions.<name>`, JSON arguments                       -> function_call
    custom       -> `functions.<name>`, freeform text (`(_: string) => any`) -> custom_tool_call
    local_shell  -> `functions.local_shell`, {"command": [...], ...}          -> local_shell_call
    namespace    -> a Harmony namespace of its own, `<namespace>.<name>`     -> function_call /
                    (its function and custom tools)                              custom_tool_call
                                                                                 with `namespace`

A custom tool with a grammar (lark or regex) is called in a " code" message whose text the turn
grammar holds to it (`turn_grammar.py`); the model is also shown the grammar in the tool's
description. Without one, its input is one JSON string (`custom_input` unquotes it). Calls are
recorded by "qualified name": the bare name in `functions`, else "<namespace>.<name>"
(`recipient_of` turns either back into the Harmony recipient).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from openai_harmony import ToolDescription, ToolNamespaceConfig

from agent_server.errors import APIError
from inference.grammar import Grammar
from schemas.responses import CustomGrammarFormat, CustomTool, FunctionTool, LocalShellTool, NamespaceTool

FUNCTIONS = "functions"
# Namespaces the server's own tools and Harmony itself use: a client namespace may not take them.
RESERVED_NAMESPACES = {FUNCTIONS, "browser", "python", "container", "assistant", "user", "system", "developer"}
LOCAL_SHELL = "local_shell"
LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {
            "type": "array",
            "items": {"type": "string"},
            "description": 'The command and its arguments, e.g. ["bash", "-lc", "ls -la"].',
        },
        "workdir": {"type": "string", "description": "The folder to run it in."},
        "timeout_ms": {"type": "number", "description": "How long it may run, in milliseconds."},
        "env": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "Environment variables to set for it.",
        },
    },
    "required": ["command"],
}
LOCAL_SHELL_DESCRIPTION = "Runs a shell command on the user's machine and returns its output."


@dataclass
class ClientTool:
    kind: str  # "function" | "custom" | "local_shell"
    name: str
    namespace: str | None = None  # None: Harmony's `functions`
    grammar: CustomGrammarFormat | None = None  # a custom tool's, for constrained decoding
    # The JSON Schema of its arguments as the turn grammar holds them (`turn_grammar.function_arguments`):
    # a function's parameters, a custom tool's one string, local_shell's command.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # held to `parameters` in every turn, not only when forced

    @property
    def text_grammar(self) -> Grammar | None:
        """The grammar a custom tool's input follows, as the engine takes it; None: any input."""
        return Grammar(self.grammar.syntax, self.grammar.definition) if self.grammar is not None else None

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}" if self.namespace else self.name

    @property
    def recipient(self) -> str:
        return recipient_of(self.qualified_name)


@dataclass
class ClientTools:
    """The client-run tools of one request."""

    functions: list[ToolDescription] = field(default_factory=list)  # the `functions` namespace
    namespaces: list[ToolNamespaceConfig] = field(default_factory=list)  # client namespaces
    by_recipient: dict[str, ClientTool] = field(default_factory=dict)

    def add(self, tools: list[Any], param: str = "tools") -> None:
        """Add a request's (or an `additional_tools` item's) client tools; APIError on clashes."""
        for i, tool in enumerate(tools):
            where = f"{param}[{i}]"
            if isinstance(tool, (FunctionTool, CustomTool, LocalShellTool)):
                self.functions.append(self._register(tool, None, where))
            elif isinstance(tool, NamespaceTool):
                if tool.name in RESERVED_NAMESPACES or any(n.name == tool.name for n in self.namespaces):
                    raise APIError(
                        f"Invalid namespace name '{tool.name}': it is taken (reserved: "
                        f"{', '.join(sorted(RESERVED_NAMESPACES))}).",
                        param=f"{where}.name",
                    )
                described = [self._register(t, tool.name, f"{where}.tools[{j}]") for j, t in enumerate(tool.tools)]
                self.namespaces.append(
                    ToolNamespaceConfig(name=tool.name, description=tool.description, tools=described)
                )

    def _register(self, tool: Any, namespace: str | None, where: str) -> ToolDescription:
        if isinstance(tool, LocalShellTool):
            entry = ClientTool("local_shell", LOCAL_SHELL, parameters=LOCAL_SHELL_PARAMETERS)
            description = ToolDescription.new(LOCAL_SHELL, LOCAL_SHELL_DESCRIPTION, parameters=LOCAL_SHELL_PARAMETERS)
        elif isinstance(tool, CustomTool):
            grammar = tool.format if isinstance(tool.format, CustomGrammarFormat) else None
            # Its input: text of its grammar where it has one, else a JSON string (`custom_input` reads both).
            entry = ClientTool("custom", tool.name, namespace, grammar, parameters={"type": "string"}, strict=True)
            description = ToolDescription.new(
                tool.name, _custom_description(tool, grammar), parameters={"type": "string"}
            )
        else:
            entry = ClientTool("function", tool.name, namespace, parameters=tool.parameters, strict=tool.strict)
            description = ToolDescription.new(tool.name, tool.description or "", parameters=tool.parameters)
        if entry.recipient in self.by_recipient:
            what = f"in namespace '{namespace}'" if namespace else "in 'tools'"
            raise APIError(f"Tool names {what} must be unique: '{entry.name}' is there twice.", param=where)
        self.by_recipient[entry.recipient] = entry
        return description


def _custom_description(tool: CustomTool, grammar: CustomGrammarFormat | None) -> str:
    text = tool.description or ""
    note = "Call it with plain text as its input, not JSON."
    if grammar is not None:
        note += f" The input must match this {grammar.syntax} grammar:\n{grammar.definition}"
    return f"{text}\n\n{note}" if text else note


def recipient_of(qualified_name: str) -> str:
    """ "get_weather" -> "functions.get_weather"; "multi.close" (a namespace's) unchanged."""
    return qualified_name if "." in qualified_name else f"{FUNCTIONS}.{qualified_name}"


def custom_input(text: str) -> str:
    """A custom tool call's input from what the model wrote: its text, or the string it wrote as
    a JSON string (the model was shown `(_: string) => any` and may quote it)."""
    stripped = text.strip()
    if stripped.startswith('"'):
        try:
            value = json.loads(stripped)
        except ValueError:
            return text
        if isinstance(value, str):
            return value
    return text


def local_shell_action(arguments: str) -> dict[str, Any]:
    """The `exec` action of a local_shell_call from the model's JSON arguments: a command given
    as one string runs through `bash -lc`; what cannot be read becomes an empty command."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = {}
    args = args if isinstance(args, dict) else {}
    command = args.get("command")
    if isinstance(command, str):
        command = ["bash", "-lc", command]
    if not (isinstance(command, list) and all(isinstance(c, str) for c in command)):
        command = []
    env = args.get("env") if isinstance(args.get("env"), dict) else {}
    timeout = args.get("timeout_ms")
    return {
        "type": "exec",
        "command": command,
        "env": {str(k): str(v) for k, v in env.items()},
        "timeout_ms": int(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else None,
        "working_directory": args.get("workdir") if isinstance(args.get("workdir"), str) else None,
        "user": None,
    }


def local_shell_arguments(action: Any) -> str:
    """A replayed local_shell_call's action as the JSON arguments the model would have written."""
    args: dict[str, Any] = {"command": list(action.command)}
    if action.working_directory:
        args["workdir"] = action.working_directory
    if action.timeout_ms is not None:
        args["timeout_ms"] = action.timeout_ms
    if action.env:
        args["env"] = dict(action.env)
    return json.dumps(args, ensure_ascii=False)
