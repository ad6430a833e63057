"""Prompts too large to tokenize on the event loop: refused by their length first, and
otherwise rendered in a worker process.

Tokenizing takes about half a microsecond a byte, and openai-harmony holds the GIL while it
does (so a thread would hold the event loop all the same): a 30 MB prompt held every other
client for 6 s before its 400. Two things keep that off the loop:

- A cheap bound. No token is longer than `MAX_TOKEN_BYTES` bytes (the vocabulary's longest is
  128 spaces) and a character is at least a byte, so a conversation of C characters is at
  least C / 128 tokens: past the context, it is refused without being tokenized.
- A conversation of more than `OFF_LOOP_CHARS` characters that may fit is rendered in a
  worker process (one, started when first needed), so the loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, TypeVar

from openai_harmony import Message

from agent_server.errors import APIError

MAX_TOKEN_BYTES = 128  # the longest token of the o200k vocabulary, in bytes (test_hardening_limits checks it)
OFF_LOOP_CHARS = 256 << 10  # about 0.1 s of tokenizing

Result = TypeVar("Result")


def text_chars(messages: Iterable[Message]) -> int:
    """Characters of the messages' text and instructions (what tokenizing takes time over; tool
    descriptions are bounded apart, see schemas.responses.MAX_REQUEST_SCHEMA_BYTES)."""
    total = 0
    for message in messages:
        for content in message.content:
            for name in ("text", "instructions"):
                value = getattr(content, name, None)
                if isinstance(value, str):
                    total += len(value)
    return total


def check_fits(messages: list[Message], max_model_len: int, param: str, what: str) -> None:
    """A 400 for messages certain to be longer than the context, from their length alone."""
    fewest = text_chars(messages) // MAX_TOKEN_BYTES
    if fewest >= max_model_len:
        raise APIError(
            f"The {what} is at least {fewest} tokens; this model's context is {max_model_len} tokens.",
            param=param,
            code="context_length_exceeded",
        )


class PromptRenderer:
    """Runs a rendering function on the loop for small conversations, in a worker process for
    large ones. `fn` and its arguments must pickle (module-level functions, harmony messages)."""

    def __init__(self, off_loop_chars: int = OFF_LOOP_CHARS):
        self.off_loop_chars = off_loop_chars
        self._pool: ProcessPoolExecutor | None = None

    async def run(self, fn: Callable[..., Result], *args: Any, chars: int) -> Result:
        if chars < self.off_loop_chars:
            return fn(*args)
        if self._pool is None:  # spawned, not forked: the server process has threads (and maybe CUDA)
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except BrokenProcessPool:  # the worker died (killed, out of memory): the next call starts another
            if self._pool is pool:
                self._pool = None
            raise APIError(
                "The worker rendering this long prompt stopped; retry the request.", status=503, code="server_error"
            ) from None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
