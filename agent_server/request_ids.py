"""Request ids: one per HTTP request, in the `x-request-id` response header and in every log
line written while the request is handled (tasks it starts inherit it through contextvars).

A client may send its own `x-request-id` (a proxy's trace id, say); it is kept when it is a
short plain token, otherwise the server makes one (`req_` + 32 hex digits).
"""

from __future__ import annotations

import contextvars
import logging
import re
import secrets
import time

log = logging.getLogger("oss_agent.access")

HEADER = b"x-request-id"
# Printable, no spaces or quotes: safe to echo in a header and to write in a log line.
CLIENT_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def new_request_id() -> str:
    return f"req_{secrets.token_hex(16)}"


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` ("-" outside a request) so formats can use `%(request_id)s`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get() or "-"
        return True


class RequestIdMiddleware:
    """Outermost middleware: picks the id, sets it for the request's context, adds the header,
    and writes one access log line when the response is done (streams included)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers") or [] if k == HEADER), None)
        request_id = given.decode() if given is not None and CLIENT_ID.fullmatch(given) else new_request_id()
        # Each request runs in its own task, so the value stays with this request (and is still
        # set when Starlette's outermost error handler runs after an unexpected exception).
        current_request_id.set(request_id)
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = repr(scope["path"])[1:-1]  # escaped: a path must not forge log lines
            log.info("%s %s %d %.1fms", scope["method"], path, status, (time.perf_counter() - started) * 1000)
