"""One Responses API, two dialects of its stream: OpenAI's (`/v1/...`) and the Open Responses
specification's (`/openresponses/v1/...`).

OpenAI's API and its SDKs and the Open Responses specification (openresponses.org, release
2026-04-24) agree on the Responses API but for a few names and fields of the stream, and each
kind of client checks its own. The server serves both, unchanged: `app.py` mounts the same
Responses routes (HTTP and the WebSocket) under `/openresponses` (`mount`), with the same auth
and store, and the routes write each event through `written`, the one place that knows the
differences:

| what | `/v1` (OpenAI) | `/openresponses/v1` (Open Responses) |
| --- | --- | --- |
| reasoning text streamed | `response.reasoning_text.delta` / `.done` | `response.reasoning.delta` / `.done` (same fields) |
| `logprobs` of `response.output_text.delta` / `.done` | `token`, `logprob`, `top_logprobs` | each with its `bytes` too, as the spec requires |
| a WebSocket `error` event with no code | `"code": null` | `"code"`: the error's type (the spec wants a string) |

Runs publish their events in OpenAI's form but with the logprobs' `bytes` (an extra field of
the SDK objects), so that one log serves readers of both dialects: a background response
streamed on one prefix can be resumed on the other.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import BaseRoute, Mount, Router

from agent_server.responses.events import dump

OPENAI = "openai"
OPEN_RESPONSES = "openresponses"
PREFIX = "/openresponses"  # + "/v1/responses...": the Open Responses dialect
SCOPE_KEY = "responses_dialect"  # in the ASGI scope's "state"

EVENT_TYPES = {  # OpenAI's name -> the Open Responses spec's
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}
WITH_LOGPROBS = frozenset({"response.output_text.delta", "response.output_text.done"})


def of(scope: dict[str, Any]) -> str:
    """The dialect a request (or WebSocket connection) is served in."""
    return scope.get("state", {}).get(SCOPE_KEY, OPENAI)


def api_path(path: str) -> str:
    """The `/v1/...` path a request path stands for (the same under either prefix)."""
    return path[len(PREFIX) :] if path.startswith(PREFIX + "/v1/") else path


def written(event: Any, dialect: str) -> Any:
    """A run's event (an SDK object, or the dict the store kept) as `dialect` writes it: the
    event itself where nothing differs (most events, without a copy), else a new dict."""
    kind = event["type"] if isinstance(event, dict) else event.type
    if kind in WITH_LOGPROBS:
        entries = event.get("logprobs") if isinstance(event, dict) else event.logprobs
        if not entries:
            return event
        data = event if isinstance(event, dict) else dump(event)
        return {**data, "logprobs": [_logprob(e, keep_bytes=dialect == OPEN_RESPONSES) for e in data["logprobs"]]}
    if dialect == OPENAI:
        return event
    renamed = EVENT_TYPES.get(kind)
    if renamed is not None:
        return {**(event if isinstance(event, dict) else dump(event)), "type": renamed}
    if kind == "error" and isinstance(event, dict) and isinstance(event.get("error"), dict):
        error = event["error"]
        if error.get("code") is None:
            return {**event, "error": {**error, "code": error.get("type") or "error"}}
    return event


def _logprob(entry: dict[str, Any], keep_bytes: bool) -> dict[str, Any]:
    def one(e: dict[str, Any]) -> dict[str, Any]:
        kept = {"token": e["token"], "logprob": e["logprob"]}
        if keep_bytes:
            kept["bytes"] = e["bytes"] if "bytes" in e else list(e["token"].encode())
        return kept

    return {**one(entry), "top_logprobs": [one(t) for t in entry.get("top_logprobs") or []]}


class _Dialect:
    """ASGI: marks the requests it passes on as served in `name`."""

    def __init__(self, app: Any, name: str):
        self.app = app
        self.name = name

    async def __call__(self, scope, receive, send) -> None:
        scope.setdefault("state", {})[SCOPE_KEY] = self.name
        await self.app(scope, receive, send)


def mount(routes: list[BaseRoute]) -> Mount:
    """`routes` (written for `/v1/...`) served again under `/openresponses`, in its dialect."""
    return Mount(PREFIX, app=_Dialect(Router(routes=routes), OPEN_RESPONSES))
