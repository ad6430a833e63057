"""One response's browsing: the page stack behind `browser.search`, `browser.open`, `browser.find`.

Every successful call pushes a page (a search results page, an opened page, the same page
scrolled, or a find results page); its index in the stack is the cursor shown as `[n]` and
used in citations. Opened pages are cached by URL for the session; opening a URL given as a
string always fetches it again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Callable

from tools.browser import citations
from tools.browser.backend import BackendError, SearchBackend
from tools.browser.documents import search_results_page
from tools.browser.page import Page, ToolUsageError, find_in_page, render_window
from tools.protocol import ToolResult

logger = logging.getLogger(__name__)

# Parameters of each function, with their defaults; "source" is accepted and ignored (one backend).
FUNCTIONS: dict[str, dict[str, Any]] = {
    "search": {"query": None, "topn": 10, "source": None},
    "open": {"id": -1, "cursor": -1, "loc": -1, "num_lines": -1, "view_source": False, "source": None},
    "find": {"pattern": None, "cursor": -1},
}
INT_PARAMETERS = {"topn", "cursor", "loc", "num_lines"}
INTEGER = re.compile(r"\s*-?[0-9]+\s*")  # ASCII digits: "²" or "--3" are no integers for int()


def default_token_counter() -> Callable[[str], int]:
    """Tokens of the model's own tokenizer (loaded offline); special-token text counts as text."""
    from inference.tokenizer import harmony_encoding

    encoding = harmony_encoding()
    return lambda text: len(encoding.encode(text, allowed_special=set(), disallowed_special=()))


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ToolUsageError(f"`{name}` should be an integer, not `{value}`")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and INTEGER.fullmatch(value):
        return int(value)
    if isinstance(value, int):
        return value
    raise ToolUsageError(f"`{name}` should be an integer, not `{type(value).__name__}`")


def parse_arguments(function: str, arguments: str) -> dict[str, Any]:
    """The model's JSON arguments, checked and with defaults filled in."""
    if arguments.strip():
        try:
            given = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ToolUsageError(f"Invalid function arguments: not JSON ({e.msg})") from e
        if not isinstance(given, dict):
            raise ToolUsageError("Invalid function arguments: expected a JSON object")
    else:
        given = {}
    if "top_n" in given and "topn" not in given:
        given["topn"] = given.pop("top_n")
    parameters = FUNCTIONS[function]
    unknown = sorted(set(given) - set(parameters))
    if unknown:
        raise ToolUsageError(
            f"Unknown argument(s) for browser.{function}: {', '.join(unknown)}. "
            f"Valid arguments: {', '.join(parameters)}."
        )
    args = {**parameters, **given}
    for name, default in parameters.items():
        if default is None and name != "source" and args[name] is None:
            raise ToolUsageError(f"browser.{function} needs `{name}`")
    for name in INT_PARAMETERS & set(args):
        args[name] = _as_int(name, args[name])
    if function == "open":
        link = args["id"]
        if isinstance(link, str) and INTEGER.fullmatch(link):
            link = int(link)  # "3" means link 3: a URL is never just digits
        args["id"] = link if isinstance(link, str) else _as_int("id", link)
        flag = args["view_source"]
        args["view_source"] = flag if isinstance(flag, bool) else str(flag).lower() == "true"
    if function in ("search", "find"):
        key = "query" if function == "search" else "pattern"
        args[key] = str(args[key])
        if not args[key].strip():  # (find would match every line, a search engine nothing)
            raise ToolUsageError(f"browser.{function} needs a non-empty `{key}`")
    return args


class BrowserSession:
    def __init__(
        self,
        backend: SearchBackend,
        *,
        view_tokens: int = 1024,
        max_search_results: int = 20,
        count_tokens: Callable[[str], int] | None = None,
    ):
        self.backend = backend
        self.view_tokens = view_tokens
        self.max_search_results = max_search_results
        self.count_tokens = count_tokens or default_token_counter()
        self.pages: list[Page] = []
        self._cache: dict[str, Page] = {}

    # -- the ToolSession interface

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        namespace, _, function = recipient.partition(".")
        if namespace != "browser" or function not in FUNCTIONS:
            return ToolResult(
                f"Unknown function: {recipient}. The browser has browser.search, browser.open and browser.find.",
                is_error=True,
                details={"action": function},
            )
        details: dict[str, Any] = {"action": function}
        try:
            args = parse_arguments(function, arguments)
            details.update({k: v for k, v in args.items() if k in ("query", "pattern")})
            text = await getattr(self, function)(details=details, **args)
            return ToolResult(text, details=details)
        except (ToolUsageError, BackendError) as e:
            return ToolResult(str(e), is_error=True, details=details)
        except Exception as e:  # noqa: BLE001 - a tool bug must not end the response
            logger.exception("browser.%s failed", function)
            return ToolResult(f"Error in browser.{function}: {type(e).__name__}: {e}", is_error=True, details=details)

    def resolve_citations(self, text: str) -> tuple[str, list[dict]]:
        return citations.resolve_citations(text, self.pages)

    async def close(self) -> None:
        self.pages.clear()
        self._cache.clear()

    # -- the functions

    async def search(self, query: str, topn: int, source: str | None, details: dict) -> str:
        topn = max(1, min(topn, self.max_search_results))
        try:
            hits = await self.backend.search(query, topn)
        except Exception as e:  # noqa: BLE001 - shown to the model
            raise BackendError(f"Error during search for `{query}`: {_message(e)}") from e
        details["sources"] = [{"url": hit.url, "title": hit.title} for hit in hits]
        return self._show(search_results_page(query, hits), loc=0, num_lines=-1, details=details)

    async def open(
        self, id: int | str, cursor: int, loc: int, num_lines: int, view_source: bool, source: str | None, details: dict
    ) -> str:
        target_line = None
        if isinstance(id, str):
            url, current = id, None
        else:
            current = self._page_at(cursor)
            if id >= 0:
                url = current.links.get(id)
                if url is None:
                    raise ToolUsageError(f"Invalid link id `{id}`.")
                target_line = current.result_lines.get(id)
            else:  # the page at the cursor; a find page's source is the page searched
                url = current.source.url if current.kind == "find" and current.source else current.url
        if view_source:
            page = await self._fetch(url, view_source=True)
        elif current is not None and id < 0:
            page = current  # scrolling the page at `cursor`
        elif current is not None and current.kind == "find":
            page = current.source or await self._fetch(url)
        else:
            page = (None if isinstance(id, str) else self._cache.get(url)) or await self._fetch(url)
            self._cache[url] = page
        if loc < 0:
            loc = max(0, target_line - 4) if target_line is not None else 0
        details.update(url=page.url or url, title=page.title)
        return self._show(page, loc=loc, num_lines=num_lines, details=details)

    async def find(self, pattern: str, cursor: int, details: dict) -> str:
        page = self._page_at(cursor)
        if page.kind == "find":
            raise ToolUsageError("Cannot run `find` on search results page or find results page")
        details["url"] = page.url
        found = await asyncio.to_thread(find_in_page, page, pattern)  # (big pages take a while)
        return self._show(found, loc=0, num_lines=-1, details=details)

    # -- helpers

    def _page_at(self, cursor: int) -> Page:
        if not self.pages:
            raise ToolUsageError("No pages to access!")
        if cursor == -1:
            return self.pages[-1]
        if not 0 <= cursor < len(self.pages):
            raise ToolUsageError(
                f"Cursor `{cursor}` is out of range. Available cursor indices: [0 - {len(self.pages) - 1}]."
            )
        return self.pages[cursor]

    async def _fetch(self, url: str, view_source: bool = False) -> Page:
        if not url:
            raise ToolUsageError("This page has no URL to open.")
        try:
            page = await self.backend.fetch(url, view_source=view_source)
        except Exception as e:  # noqa: BLE001 - shown to the model
            raise BackendError(f"Error fetching URL `{url[:1024]}`: {_message(e)}") from e
        await asyncio.to_thread(lambda: page.lines)  # wrapping a big page takes a while
        return page

    def _show(self, page: Page, loc: int, num_lines: int, details: dict) -> str:
        """Push `page` and render it; a window out of range pops it again."""
        self.pages.append(page)
        cursor = len(self.pages) - 1
        try:
            text = render_window(page, cursor, loc, num_lines, self.view_tokens, self.count_tokens)
        except ToolUsageError:
            self.pages.pop()
            raise
        details["cursor"] = cursor
        return text


def _message(error: Exception) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= 1024 else text[:1021] + "..."
