"""Web search and page fetching through Exa (https://exa.ai), with the official `exa-py` SDK.

`search` asks for query-relevant highlights to show under each result; `fetch` asks for a
page's text with its HTML tags, so links survive and can be followed. Rate limits (429),
server errors (5xx) and dropped connections are retried with backoff; a timeout is not
retried (it already cost the full wait). Every failure surfaces as `BackendError`, which the
browser turns into a tool message.
"""

from __future__ import annotations

import re

import httpx
from exa_py import AsyncExa
from exa_py.errors import ExaTimeoutError

from tools.browser.backend import BackendError, RetryPolicy, TransientError, with_retries
from tools.browser.documents import SearchHit, looks_like_html, page_from_html, page_from_text, source_page
from tools.browser.page import Page

EXA_API_URL = "https://api.exa.ai"
STATUS_IN_MESSAGE = re.compile(r"status code (\d{3})")
MAX_ERROR_CHARS = 300


class ExaBackend:
    source_name = "web"

    def __init__(
        self,
        api_key: str,
        *,
        base_url: str = EXA_API_URL,
        timeout: float = 20.0,
        retry: RetryPolicy | None = None,
        max_page_chars: int = 200_000,
    ):
        self.client = AsyncExa(api_key=api_key, api_base=base_url, timeout=timeout)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.max_page_chars = max_page_chars

    async def _call(self, what: str, make_request):
        async def attempt():
            try:
                return await make_request()
            except ExaTimeoutError as e:
                raise BackendError(f"the request timed out after {self.timeout:g}s") from e
            except ValueError as e:  # the SDK's error for a non-2xx answer
                message = str(e)
                match = STATUS_IN_MESSAGE.search(message)
                status = int(match.group(1)) if match else 0
                short = message[:MAX_ERROR_CHARS]
                if status == 429 or status >= 500:
                    raise TransientError(short) from e
                raise BackendError(short) from e
            except httpx.TransportError as e:  # connection refused, reset, ...
                raise TransientError(f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]) from e

        return await with_retries(attempt, self.retry, what)

    async def search(self, query: str, topn: int) -> list[SearchHit]:
        response = await self._call(
            f"Exa search {query!r}",
            lambda: self.client.search(query, num_results=topn, contents={"highlights": True}),
        )
        hits = []
        for result in response.results:
            snippet = " ... ".join(result.highlights or []) or result.summary or (result.text or "")[:500]
            hits.append(SearchHit(url=result.url, title=result.title or result.url, snippet=snippet))
        return hits

    async def fetch(self, url: str, *, view_source: bool = False) -> Page:
        response = await self._call(
            f"Exa contents {url!r}",
            lambda: self.client.get_contents(
                [url], text={"include_html_tags": True, "max_characters": self.max_page_chars}
            ),
        )
        if not response.results:
            raise BackendError(f"no contents returned for {url}")
        result = response.results[0]
        text, title = result.text or "", result.title or None
        if view_source:
            return source_page(text, url, title)
        if looks_like_html(text):
            return page_from_html(text, url, title)
        return page_from_text(text, url, title)

    async def aclose(self) -> None:
        await self.client.aclose()
