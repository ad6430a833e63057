"""Turning the model's citations into links the user can follow.

gpt-oss cites what it read as `【{cursor}†L{start}(-L{end})?】` (the cursor of the page in the
browser's page stack, and the lines). In the final text each citation becomes a Markdown link
to the cited page, ` ([domain](url))`, and an OpenAI `url_citation` annotation whose
`start_index`/`end_index` span exactly that link in the returned text. This is how OpenAI's
own web search presents sources, so clients that render Markdown show a link and clients that
read annotations get the URL and title.

- A page opened by the browser: its URL and title.
- A search results page: the result(s) on the cited lines (or the nearest result above them);
  the link's text is the title.
- A find results page: the page that was searched.
- Consecutive citations of the same URL collapse into one link.
- Citations that cannot be resolved (no such cursor, a search page line with no result) and an
  unfinished citation at the very end are removed, so the user never sees raw markers.
- The link gets a space before it unless the text before it ends in whitespace. A citation at
  the very start of `text` gets one too: that is what a streaming caller that resolves one
  marker at a time passes, and gpt-oss writes citations right after the words they support.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from tools.browser.page import LINK_MARKER, Page, domain_of

CITATION = re.compile(r"【(\d+)†([^】]*)】")
LINE_RANGE = re.compile(r"^\s*L(\d+)(?:\s*[-–]\s*L?(\d+))?\s*$")
UNFINISHED_AT_END = re.compile(r"【\d*(?:†[^】]*)?$")
PUNCTUATION_AFTER_A_MARK = ".,;:!?)"  # an unresolvable mark before these takes the spaces before it too


@dataclass(frozen=True)
class CitedSource:
    url: str
    title: str


def _lines_cited(spec: str) -> tuple[int, int] | None:
    match = LINE_RANGE.match(spec)
    if match is None:
        return None
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) else start
    return min(start, end), max(start, end)


def _search_result_at(page: Page, lines: tuple[int, int] | None) -> CitedSource | None:
    """The result whose link marker is on the cited lines, else the nearest one above them."""
    if lines is None:
        return None
    start, end = lines
    text_lines = page.lines
    end = min(end, len(text_lines) - 1)
    candidates = list(range(start, end + 1)) + list(range(min(start, len(text_lines)) - 1, -1, -1))
    for i in candidates:
        marker = LINK_MARKER.search(text_lines[i]) or re.search(r"【(\d+)†([^†】]*)", text_lines[i])
        if marker is not None:
            url = page.links.get(int(marker.group(1)))
            if url:
                return CitedSource(url=url, title=marker.group(2).strip() or url)
    return None


def cited_source(pages: Sequence[Page], cursor: int, spec: str) -> CitedSource | None:
    """What a citation `【cursor†spec】` refers to, or None."""
    if not 0 <= cursor < len(pages):
        return None
    page = pages[cursor]
    if page.kind == "search":
        return _search_result_at(page, _lines_cited(spec))
    if page.kind == "find" and page.source is not None:
        page = page.source
    if not page.url:
        return None
    url = page.url.removeprefix("view-source:")
    return CitedSource(url=url, title=page.title or url)


def resolve_citations(text: str, pages: Sequence[Page]) -> tuple[str, list[dict]]:
    """Replace citation markers with Markdown links; return the text and its annotations."""
    text = UNFINISHED_AT_END.sub("", text)
    out: list[str] = []
    annotations: list[dict] = []
    length = 0  # characters in `out` so far
    last_char = ""

    def emit(piece: str) -> None:
        nonlocal length, last_char
        if piece:
            out.append(piece)
            length += len(piece)
            last_char = piece[-1]

    def drop_trailing_spaces() -> None:
        nonlocal length, last_char
        if out and out[-1].endswith(" "):
            kept = out[-1].rstrip(" ")
            length -= len(out[-1]) - len(kept)
            out[-1] = kept
            last_char = kept[-1:] or ("".join(out)[-1:])

    last_end = 0
    previous: tuple[CitedSource, int] | None = None  # the last link, and where it ended
    for match in CITATION.finditer(text):
        between = text[last_end : match.start()]
        last_end = match.end()
        source = cited_source(pages, int(match.group(1)), match.group(2))
        if source is None:
            emit(between)
            following = text[last_end : last_end + 1]
            if not following or following.isspace() or following in PUNCTUATION_AFTER_A_MARK:
                drop_trailing_spaces()  # "fact 【9†L1】." -> "fact."
            continue
        if previous == (source, length) and not between.strip():
            continue  # the same source cited again right away
        emit(between)
        if (length and not last_char.isspace()) or match.start() == 0:
            emit(" ")
        link = f"([{domain_of(source.url) or source.title}]({source.url}))"
        annotations.append(
            {
                "type": "url_citation",
                "start_index": length,
                "end_index": length + len(link),
                "url": source.url,
                "title": source.title,
            }
        )
        emit(link)
        previous = (source, length)
    emit(text[last_end:])
    return "".join(out), annotations
