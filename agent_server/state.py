"""What the routes share: the server's settings and the live objects built at startup."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.request import EngineClient

from .large_prompts import PromptRenderer
from .metrics import Metrics
from .runs import RunRegistry
from .store import ResponseStore
from .tool_registry import ToolRegistry


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
    tool_timeout: float = 300.0  # seconds one built-in tool call may take
    max_request_bytes: int = 32 << 20
    max_input_items: int = 2048  # items in `input` / `messages`
    max_tools: int = 128
    shutdown_timeout: float = 30.0  # seconds in-flight responses get to finish when stopping
    cors_origins: list[str] = field(default_factory=list)  # CORS is off unless origins are given
    # Host names answered besides loopback names and IP addresses ("*": any); see cross_site.
    allowed_hosts: list[str] = field(default_factory=list)
    sse_ping_seconds: float = 15.0

    def serves(self, model: str) -> bool:
        return model == self.model_name or model in self.aliases


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

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.store is not None
