"""`/v1/responses` over a WebSocket, as the `openai` SDK's `client.responses.connect()` speaks it.

The client sends JSON messages, one per WebSocket message:

- `response.create`: a create request's body (without `stream`, which is implied, and
  `background`, which is not taken here), with an optional `stream_id`. The response's events
  come back one message each, the same objects as the SSE stream's `data`, carrying the
  `stream_id` when the request gave one. Several responses may run at once on a connection.
  With `generate: false` (Codex's prewarm) the response completes at once with no output: a
  conversation that `previous_response_id` continues.
- `response.cancel`, as in OpenAI's Realtime API: stops the response `response_id`, or every
  response running on the connection when it names none. Its events end as a cancelled
  response's do over HTTP.

A message that cannot be served (a request that fails validation, an unknown type) gets an
`error` event with the status the same request would get over HTTP:
`{"type": "error", "status": 400, "error": {"message", "type", "param", "code"}}`.

The connection remembers its most recent store=false responses (`MAX_KEPT`), so that
`previous_response_id` continues one on the same connection (another connection, or HTTP, gets
`previous_response_not_found`); a continuation that fails forgets the response it named. The
API key is checked at the handshake, as for HTTP (`agent_server/auth.py`); closing the
connection cancels what runs on it. Under `/openresponses/v1/responses` the events are named
as the Open Responses specification names them (`agent_server/responses/dialect.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from agent_server.auth import request_owner
from agent_server.errors import APIError, internal_error
from agent_server.request_parsing import parse_json_object, too_large, validate_body
from agent_server.responses import dialect
from agent_server.responses.events import dump
from agent_server.responses.lifecycle import start_run
from agent_server.responses.prepare import prepare
from agent_server.responses.routes import UNSUPPORTED
from agent_server.responses.runs import ResponseRun
from agent_server.state import ServerState
from agent_server.store import StoredResponse
from schemas.responses import ResponseCreateRequest

log = logging.getLogger(__name__)

MAX_KEPT = 8  # store=false responses a connection remembers for previous_response_id


class ResponsesSocket:
    """One WebSocket connection: its messages in, its responses' events out."""

    def __init__(self, websocket: WebSocket, state: ServerState):
        self.websocket = websocket
        self.state = state
        self.dialect = dialect.of(websocket.scope)  # the stream's event names (`dialect.py`)
        self.kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self.runs: dict[str, ResponseRun] = {}
        self.forwarding: set[asyncio.Task] = set()
        self.sending = asyncio.Lock()  # one message at a time on the socket

    async def serve(self) -> None:
        await self.websocket.accept()
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text")
                error = await self.handle(raw.encode() if raw is not None else message.get("bytes") or b"")
                if error is not None:
                    await self.send(*error)
        except (WebSocketDisconnect, OSError, RuntimeError):  # gone while an error was being sent
            return
        finally:
            for run in list(self.runs.values()):
                run.cancel()
            await asyncio.gather(*self.forwarding, return_exceptions=True)

    async def handle(self, raw: bytes) -> tuple[dict[str, Any], str | None] | None:
        """Serve one message; the error event to send back (and its stream id), if it failed."""
        stream_id = None
        try:
            if len(raw) > self.state.config.max_request_bytes:
                raise too_large(self.state.config.max_request_bytes)
            body = parse_json_object(raw)
            stream_id = body.pop("stream_id", None)
            if stream_id is not None and not isinstance(stream_id, str):
                stream_id = None
                raise APIError(
                    "Invalid type for 'stream_id': expected a string.", param="stream_id", code="invalid_type"
                )
            kind = body.pop("type", None)
            if kind == "response.create":
                await self.create(body, stream_id)
            elif kind == "response.cancel":
                self.cancel(body)
            elif kind == "response.steer":
                raise APIError(
                    "'response.steer' is not supported by this server: send a new 'response.create' with "
                    "previous_response_id once the response has ended.",
                    param="type",
                    code="unsupported_value",
                )
            else:
                raise APIError(
                    f"Invalid value for 'type': {kind!r}. This server takes 'response.create' and "
                    "'response.cancel' messages.",
                    param="type",
                    code="invalid_value",
                )
        except APIError as e:
            return {"type": "error", "status": e.status, **e.body()}, stream_id
        except Exception:
            log.exception("a WebSocket message could not be served")
            error = internal_error()
            return {"type": "error", "status": error.status, **error.body()}, stream_id
        return None

    async def create(self, body: dict[str, Any], stream_id: str | None) -> None:
        started = time.perf_counter()
        if body.get("background") is True:
            raise APIError(
                "Background responses are not supported over a WebSocket; create them with POST /v1/responses.",
                param="background",
                code="unsupported_parameter",
            )
        generate = body.pop("generate", True)
        if not isinstance(generate, bool):
            raise APIError("Invalid type for 'generate': expected a boolean.", param="generate", code="invalid_type")
        for implied in ("stream", "background"):  # (over a WebSocket, the stream is the point)
            body.pop(implied, None)
        config = self.state.config
        req = validate_body(
            body,
            ResponseCreateRequest,
            unsupported=UNSUPPORTED,
            max_items={"input": config.max_input_items, "tools": config.max_tools},
        )
        try:
            prepared = await prepare(self.state, req, started, request_owner(self.websocket), local_responses=self.kept)
        except APIError:
            if req.previous_response_id:  # a failed continuation: the connection forgets what it named
                self.kept.pop(req.previous_response_id, None)
            raise
        run = start_run(self.state, prepared, keep=self.keep, generate=generate)
        self.runs[run.response_id] = run
        task = asyncio.create_task(self.forward(run, stream_id))
        self.forwarding.add(task)
        task.add_done_callback(self.forwarding.discard)

    def cancel(self, body: dict[str, Any]) -> None:
        unknown = sorted(set(body) - {"response_id", "event_id"})
        if unknown:
            raise APIError(f"Unknown parameter: '{unknown[0]}'.", param=unknown[0], code="unknown_parameter")
        response_id = body.get("response_id")
        if response_id is not None:
            run = self.runs.get(response_id) if isinstance(response_id, str) else None
            if run is None:
                raise APIError(
                    f"No response with id '{response_id}' is in progress on this connection.",
                    status=404,
                    param="response_id",
                    code="not_found",
                )
            run.cancel()
            return
        if not self.runs:
            raise APIError("No response is in progress on this connection.", code="no_response_in_progress")
        for run in list(self.runs.values()):
            run.cancel()

    def keep(self, record: StoredResponse) -> None:
        self.kept[record.id] = record
        while len(self.kept) > MAX_KEPT:
            self.kept.popitem(last=False)

    async def forward(self, run: ResponseRun, stream_id: str | None) -> None:
        try:
            async for event in run.stream():
                await self.send(event if isinstance(event, dict) else dump(event), stream_id)
        except Exception:  # the client went away: nobody reads this response any more
            run.cancel()
        finally:
            self.runs.pop(run.response_id, None)

    async def send(self, payload: dict[str, Any], stream_id: str | None = None) -> None:
        payload = dialect.written(payload, self.dialect)
        if stream_id is not None:
            payload = {**payload, "stream_id": stream_id}
        async with self.sending:
            await self.websocket.send_text(json.dumps(payload, separators=(",", ":")))


async def responses_socket(websocket: WebSocket) -> None:
    await ResponsesSocket(websocket, websocket.app.state.server).serve()


routes = [WebSocketRoute("/v1/responses", responses_socket)]
