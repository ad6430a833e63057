"""The interface every search backend implements, and the retry policy they share."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, TypeVar

from tools.browser.documents import SearchHit
from tools.browser.page import Page

logger = logging.getLogger(__name__)
T = TypeVar("T")


class BackendError(Exception):
    """A search or fetch failed; the message is shown to the model."""


class TransientError(BackendError):
    """A failure worth retrying: rate limited (429), a server error (5xx), a dropped connection."""


class SearchBackend(Protocol):
    source_name: str  # what the browser's tool description calls the source, e.g. "web"

    async def search(self, query: str, topn: int) -> list[SearchHit]: ...

    async def fetch(self, url: str, *, view_source: bool = False) -> Page: ...

    async def aclose(self) -> None: ...


@dataclass
class RetryPolicy:
    attempts: int = 3  # in all, the first included
    base_delay: float = 0.5  # seconds before the first retry; doubles each time
    max_delay: float = 8.0

    def delay(self, retry: int) -> float:
        # Full jitter: spread out clients that failed together.
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**retry))


async def with_retries(call: Callable[[], Awaitable[T]], policy: RetryPolicy, what: str) -> T:
    """Run `call`, retrying `TransientError`s with exponential backoff."""
    for attempt in range(policy.attempts):
        try:
            return await call()
        except TransientError as e:
            if attempt + 1 >= policy.attempts:
                raise BackendError(f"{e} (gave up after {policy.attempts} attempts)") from e
            delay = policy.delay(attempt)
            logger.info("%s failed (%s); retrying in %.2fs", what, e, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
