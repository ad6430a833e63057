"""What the routes share: the server's settings and the live objects built at startup."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_server.agent.tool_registry import ToolRegistry
from agent_server.large_prompts import PromptRenderer
from agent_server.metrics import Metrics
from agent_server.reasoning_seal import ReasoningSeal
from agent_server.responses.runs import RunRegistry
from agent_server.store import ResponseStore
from inference.request import EngineClient


def default_store_path() -> Path:
    import os

    root = Path(os.environ.get("OSS_AGENT_CACHE", Path.home() / ".cache" / "oss-agent"))
    return root / "responses.sqlite3"


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and responses echo
    aliases: list[str] = field(default_factory=list)  # other names requests may use for it
    api_key: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> owner name (--api-keys-file)
    store_path: Path = field(default_factory=default_store_path)
    # A PostgreSQL URL: the store several servers share, instead of the SQLite file at store_path.
    store_url: str | None = None
    tool_timeout: float = 300.0  # seconds one built-in tool call may take
    max_request_bytes: int = 32 << 20
    max_input_items: int = 2048  # items in `input` / `messages`
    max_tools: int = 128
    shutdown_timeout: float = 30.0  # seconds in-flight responses get to finish when stopping
    cors_origins: list[str] = field(default_factory=list)  # CORS is off unless origins are given
    # Host names answered besides loopback names and IP addresses ("*": any); see cross_site.
    allowed_hosts: list[str] = field(default_factory=list)
    sse_ping_seconds: float = 15.0
    # The output limit of a request that sets none (None: the rest of the context).
    default_max_output_tokens: int | None = None
    random_weights: bool = False  # the tiny default model: /v1/models says so, and the playground
    # The key that seals reasoning for stateless clients; None: reasoning.key beside the store.
    reasoning_key_file: Path | None = None
    # Hold every generated turn to Harmony's structure (`agent_server/turn_grammar.py`); off, only
    # what a request asks to be enforced is (strict schemas, json_object, a forced tool).
    harmony_grammar: bool = True

    @property
    def reasoning_key_path(self) -> Path:
        return self.reasoning_key_file or self.store_path.with_name("reasoning.key")

    def serves(self, model: str) -> bool:
        return model == self.model_name or model in self.aliases

    def output_limit(self, requested: int | None, room: int) -> int | None:
        """The output tokens a request gets: its own limit, else the server's default (within
        the `room` its prompt leaves), else None (up to the end of the context)."""
        if requested is not None or self.default_max_output_tokens is None:
            return requested
        return min(self.default_max_output_tokens, room)


@dataclass
class ServerState:
    config: ServerConfig
    metrics: Metrics
    runs: RunRegistry = field(default_factory=RunRegistry)
    tools: ToolRegistry = field(default_factory=ToolRegistry)
    engine: EngineClient | None = None
    store: ResponseStore | None = None
    renderer: PromptRenderer = field(default_factory=PromptRenderer)  # long prompts are rendered off the loop
    extra: dict[str, Any] = field(default_factory=dict)
    _seal: ReasoningSeal | None = None

    @property
    def seal(self) -> ReasoningSeal:
        """The reasoning seal, its key read (or created) on first use."""
        if self._seal is None:
            self._seal = ReasoningSeal.from_file(self.config.reasoning_key_path)
        return self._seal

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.store is not None
