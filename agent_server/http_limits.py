"""Limits on each HTTP/1.1 connection, below the ASGI app: how large a request head may be, how
long its head and its body may take, and how long a connection may sit idle.

uvicorn's httptools protocol (what `oss-agent serve` runs) bounds none of them: a client that
never finishes a header line keeps its connection forever, and httptools joins the pieces of a
header line as they arrive, one bytes concatenation per read, so a long line sent in small
pieces costs time quadratic in its length on the event loop, which every other client waits on.
`LimitedHttpToolsProtocol` holds the bytes of a head back until its blank line has arrived
and hands the parser the whole head at once (no quadratic joining), answers 431 past
`max_head_bytes`, and closes a connection whose head takes longer than `head_timeout` (408
when nothing is being answered on it) or whose body takes longer than `body_timeout`. A
connection that sends nothing at all is closed after `head_timeout` too; between requests
uvicorn's keep-alive timeout closes it.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_END = re.compile(rb"\n\r?\n")  # the blank line ending a head (bare LF line ends too)


@dataclass(frozen=True)
class HttpLimits:
    max_head_bytes: int = 64 << 10  # request line and headers
    head_timeout: float = 10.0  # seconds from a head's first byte (or the connection) to its blank line
    body_timeout: float = 60.0  # seconds from the end of the head to the end of the body
    keep_alive_timeout: float = 5.0  # seconds an idle connection is kept between requests


def _raw_error(status: str, message: str, code: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # between a message's end (or the connection's start) and the next head's end
        self._held = bytearray()  # bytes of the head not given to the parser yet
        self._fed_tail = b""  # the last bytes given to the parser (a blank line can span two reads)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    # -- connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._held = bytearray()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._reading_head:
            self._feed(data)
            return
        self._unset_keepalive_if_required()
        if self._head_timer is None:  # the first byte of the next request
            self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_too_slow)
        start = max(0, len(self._held) - 2)
        self._held += data
        found = HEAD_END.search(self._held, start)
        # The blank line may begin in what the parser already has (a head that began in the read
        # that ended the previous request).
        spans = found is None and HEAD_END.search(self._fed_tail + bytes(self._held[:3])) is not None
        head_length = found.end() if found else (0 if spans else len(self._held))  # (body bytes may follow)
        if head_length > self.limits.max_head_bytes:
            self._held = bytearray()
            self._refuse(
                b"431 Request Header Fields Too Large",
                f"The request line and headers are larger than {self.limits.max_head_bytes} bytes.",
                "request_header_fields_too_large",
            )
        elif found or spans:
            held, self._held = bytes(self._held), bytearray()
            self._feed(held)

    def _feed(self, data: bytes) -> None:
        self._fed_tail = (self._fed_tail + data[-3:])[-3:]
        super().data_received(data)

    # -- parser callbacks ----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._reading_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._reading_head = True
        super().on_message_complete()

    # -- limits --------------------------------------------------------------------------------

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: bytes, message: str, code: str) -> None:
        """An error in place of a response, then close (unless a response is being sent)."""
        if not self.transport.is_closing():
            if not self._answering():
                self.transport.write(_raw_error(status.decode(), message, code))
            self.transport.close()

    def _head_too_slow(self) -> None:
        self._head_timer = None
        self._refuse(
            b"408 Request Timeout",
            f"The request line and headers took longer than {self.limits.head_timeout:g} seconds to arrive.",
            "request_timeout",
        )

    def _body_too_slow(self) -> None:
        # The app is reading the body (it then sees a disconnect) or has answered already.
        self._body_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """uvicorn.Config keywords that apply `limits`."""
    protocol = type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
    return {
        "http": protocol,
        "timeout_keep_alive": limits.keep_alive_timeout,
        "h11_max_incomplete_event_size": limits.max_head_bytes,
    }
