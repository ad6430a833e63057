"""A page as the browsing model sees it: text wrapped into numbered lines, with link markers.

Links inside a page's text are written `【{id}†{link text}】` (same domain) or
`【{id}†{link text}†{domain}】`; `browser.open` takes the id. A page is shown through a window
of lines, each prefixed `L{n}: `, under a header with the page's cursor, title, URL and the
line range shown. These are the formats gpt-oss was trained on (OpenAI's reference
`gpt_oss.tools.simple_browser` produces the same).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable
from urllib.parse import quote, unquote, urlparse

LINE_WIDTH = 80
MAX_HEADER_URL = 1024
# A link marker, possibly cut by line wrapping at either end.
LINK_MARKER = re.compile(r"【(\d+)†([^†】]*)(?:†[^†】]*)?】")
PARTIAL_MARKER_AT_START = re.compile(r"^[^【】]*】")
PARTIAL_MARKER_AT_END = re.compile(r"【\d*(?:†(?P<text>[^†】]*)(?:†[^†】]*)?)?$")


class ToolUsageError(Exception):
    """The model called the browser wrongly; the message is shown to it."""


@dataclass(eq=False)
class Page:
    url: str  # "" for a search results page
    title: str
    text: str  # with link markers
    links: dict[int, str] = field(default_factory=dict)  # link id -> absolute URL
    kind: str = "page"  # "page" | "search" | "find"
    # Find results only: the page searched, and the line in it each result link points at.
    source: Page | None = None
    result_lines: dict[int, int] = field(default_factory=dict)

    @cached_property
    def lines(self) -> list[str]:
        return wrap_lines(self.text)


def wrap_lines(text: str, width: int = LINE_WIDTH) -> list[str]:
    """Split into lines of at most `width` characters, keeping empty lines and whitespace.

    The lines are those of `textwrap.wrap(line, width, replace_whitespace=False,
    drop_whitespace=False)` (the reference browser's), in time linear in the text: textwrap
    copies what is left of a word longer than a line for each line it fills, so one long run
    without spaces (a minified file, base64) took quadratic time."""
    lines: list[str] = []
    for line in text.split("\n"):
        if len(line) <= width and "\t" not in line:
            lines.append(line)  # (what textwrap returns for a line that fits)
        else:
            lines.extend(_wrap_chunks(_chunks(line), width) or [""])
    return lines


_SPLITTER = textwrap.TextWrapper(replace_whitespace=False, drop_whitespace=False)
# textwrap's whitespace is ASCII only; without a hyphen its word splitting comes down to this.
_ASCII_SPACE_RUNS = re.compile(r"([\t\n\x0b\x0c\r ]+)")


def _chunks(line: str) -> list[str]:
    """textwrap's chunks of a line (words and whitespace runs, tabs expanded)."""
    if "-" in line:
        return _SPLITTER._split_chunks(line)
    return [chunk for chunk in _ASCII_SPACE_RUNS.split(line.expandtabs()) if chunk]


def _wrap_chunks(chunks: list[str], width: int) -> list[str]:
    """textwrap's line filling (no indent, whitespace kept, long words broken, after a hyphen
    where one falls in the line), with the part of a long word already placed counted by an
    offset instead of cut off a copy."""
    lines: list[str] = []
    i, offset = 0, 0  # the next chunk, and how much of it earlier lines took
    while i < len(chunks):
        line: list[str] = []
        used = 0
        while i < len(chunks) and used + len(chunks[i]) - offset <= width:
            line.append(chunks[i][offset:])
            used += len(chunks[i]) - offset
            i, offset = i + 1, 0
        if i < len(chunks) and len(chunks[i]) - offset > width:
            chunk, end = chunks[i], width - used
            hyphen = chunk.rfind("-", offset, offset + end)
            if hyphen > offset and chunk[offset:hyphen].strip("-"):
                end = hyphen - offset + 1
            line.append(chunk[offset : offset + end])
            offset += end
        lines.append("".join(line))
    return lines


def domain_of(url: str) -> str:
    """The host of a URL ("" for file: URLs); scheme-less strings are read as hosts."""
    parsed = urlparse(url)
    if parsed.scheme:
        return parsed.netloc
    return urlparse("http://" + url).netloc


def clean_text(text: str) -> str:
    """Page text from outside must not fake our markers: swap the brackets for look-alikes."""
    return text.replace("【", "〖").replace("】", "〗").replace("\u200b", "")


def link_marker(link_id: int, text: str, url: str, page_domain: str) -> str:
    text = " ".join(text.replace("†", "‡").split())
    domain = domain_of(url)
    if domain and domain != page_domain:
        return f"【{link_id}†{text}†{domain}】"
    return f"【{link_id}†{text}】"


def strip_links(text: str) -> str:
    """Replace link markers by their text (also markers cut at a line's start or end)."""
    text = PARTIAL_MARKER_AT_START.sub("", text)
    text = PARTIAL_MARKER_AT_END.sub(lambda m: m.group("text") or "", text)
    # A marker wrapped across lines keeps its line breaks (find's line numbers count them).
    return LINK_MARKER.sub(lambda m: m.group(2) + "\n" * (m.group(0).count("\n") - m.group(2).count("\n")), text)


def window_end(lines: list[str], loc: int, num_lines: int, view_tokens: int, count_tokens: Callable[[str], int]) -> int:
    """One past the last line to show from `loc`: `num_lines` lines if given (> 0), else as
    many numbered lines as fit in `view_tokens` tokens (the line that crosses counts)."""
    total = len(lines)
    if num_lines > 0:
        return min(loc + num_lines, total)
    used = 0
    for i in range(loc, total):
        used += count_tokens(f"L{i}: {lines[i]}\n")
        if used >= view_tokens:
            return i + 1
    return total


def render_window(
    page: Page, cursor: int, loc: int, num_lines: int, view_tokens: int, count_tokens: Callable[[str], int]
) -> str:
    """The tool message for showing `page` at `loc`: header, scrollbar, numbered lines."""
    lines = page.lines
    total = len(lines)
    if loc >= total or loc < 0:
        raise ToolUsageError(f"Invalid location parameter: `{loc}`. Cannot exceed page maximum of {total - 1}.")
    end = window_end(lines, loc, num_lines, view_tokens, count_tokens)
    body = "\n".join(f"L{i}: {lines[i]}" for i in range(loc, end))
    header = page.title
    if page.url:
        url = unquote(page.url)
        if len(url) > MAX_HEADER_URL:
            url = url[: MAX_HEADER_URL - 3] + "..."
        header += f" ({url})"
    return f"[{cursor}] {header}\n**viewing lines [{loc} - {end - 1}] of {total - 1}**\n\n{body}"


def find_in_page(page: Page, pattern: str, max_results: int = 50, context_lines: int = 4) -> Page:
    """A find results page: each case-insensitive match of `pattern` in `page`, with the lines
    that follow it, under a link to where it is."""
    needle = pattern.lower()
    lines = strip_links("\n".join(page.lines)).split("\n")
    chunks: list[str] = []
    result_lines: dict[int, int] = {}
    i = 0
    while i < len(lines) and len(chunks) < max_results:
        if needle not in lines[i].lower():
            i += 1
            continue
        match_id = len(chunks)
        snippet = "\n".join(lines[i : i + context_lines])
        chunks.append(f"# 【{match_id}†match at L{i}】\n{snippet}")
        result_lines[match_id] = i
        i += context_lines
    text = "\n\n".join(chunks) if chunks else f"No `find` results for pattern: `{pattern}`"
    return Page(
        url=f"{page.url}/find?pattern={quote(pattern)}",
        title=f"Find results for text: `{pattern}` in `{page.title}`",
        text=text,
        links={match_id: page.url for match_id in result_lines},
        kind="find",
        source=page,
        result_lines=result_lines,
    )
