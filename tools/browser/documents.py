"""Building `Page`s from what backends return: HTML, Markdown, plain text, search hits."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urljoin

from tools.browser.html_text import html_to_text
from tools.browser.page import Page, clean_text, domain_of, link_marker

HTML_HINT = re.compile(r"<(?:html|body|p|div|a|h[1-6]|ul|ol|li|br|table|span|article)\b", re.I)
MARKDOWN_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MARKDOWN_TITLE = re.compile(r"^#\s+(.+?)\s*#*\s*$", re.M)
MARKDOWN_STRUCTURE = re.compile(r"^(?:\s{4}|\t|#|\||>|[-*+]\s|\d+[.)]\s|```|~~~|<)")


@dataclass
class SearchHit:
    url: str
    title: str
    snippet: str  # a few sentences; whitespace is merged when shown


def _with_url_line(url: str, body: str) -> str:
    # Pages open with their URL on a line of its own, as in the reference browser.
    return f"\nURL: {url}\n{body}"


def looks_like_html(text: str) -> bool:
    return bool(HTML_HINT.search(text[:20000]))


def page_from_html(html: str, url: str, title: str | None = None) -> Page:
    converted = html_to_text(html, base_url=url)
    title = title or converted.title or domain_of(url) or url
    return Page(url=url, title=title, text=_with_url_line(url, converted.text), links=converted.links)


def page_from_markdown(markdown: str, url: str, title: str | None = None) -> Page:
    """Markdown stays as it is, except links become link markers and images placeholders."""
    links: dict[int, str] = {}
    ids: dict[str, int] = {}
    images = 0
    page_domain = domain_of(url)

    def replace(match: re.Match) -> str:
        nonlocal images
        is_image, text, target = match.group(1), match.group(2).strip(), match.group(3)
        if is_image:
            images += 1
            return f"[Image {images - 1}: {text}]" if text else f"[Image {images - 1}]"
        if target.startswith("#") or not text:
            return text
        target = urljoin(url, target)
        link_id = ids.setdefault(target, len(links))
        links[link_id] = target
        return link_marker(link_id, text, target, page_domain)

    body = MARKDOWN_LINK.sub(replace, clean_text(reflow_markdown(markdown)))
    if title is None:
        heading = MARKDOWN_TITLE.search(markdown)
        title = heading.group(1) if heading else url
    return Page(url=url, title=title, text=_with_url_line(url, body.strip("\n")), links=links)


def reflow_markdown(markdown: str) -> str:
    """Join the hard-wrapped lines of each plain paragraph (the browser wraps at its own width);
    headings, lists, tables, quotes and code stay line by line."""
    blocks, paragraph, in_code = [], [], False
    for line in markdown.split("\n"):
        fence = line.lstrip().startswith(("```", "~~~"))
        if in_code or fence or not line.strip() or MARKDOWN_STRUCTURE.match(line):
            if paragraph:
                blocks.append(" ".join(part.strip() for part in paragraph))
                paragraph = []
            blocks.append(line)
            in_code = in_code != fence
        else:
            paragraph.append(line)
    if paragraph:
        blocks.append(" ".join(part.strip() for part in paragraph))
    return "\n".join(blocks)


def page_from_text(text: str, url: str, title: str | None = None) -> Page:
    return Page(url=url, title=title or url, text=_with_url_line(url, clean_text(text).strip("\n")))


def source_page(source: str, url: str, title: str | None = None) -> Page:
    """`view_source`: the raw document, lines numbered, no links."""
    return Page(url=f"view-source:{url}", title=title or url, text=clean_text(source))


def search_results_page(query: str, hits: list[SearchHit]) -> Page:
    """The numbered result list: one `  * 【i†title†domain】 snippet` item per hit (or a line
    saying there is none, so the model is not left reading an empty page)."""
    items = []
    for i, hit in enumerate(hits):
        marker = link_marker(i, clean_text(hit.title) or hit.url, hit.url, page_domain="")
        snippet = " ".join(clean_text(hit.snippet).split())
        items.append(f"  * {marker} {snippet}".rstrip())
    body = "# Search Results\n\n" + ("\n".join(items) if items else f"No results for `{query}`.")
    return Page(
        url="",
        title=query,
        text=_with_url_line("", body),
        kind="search",
        links={i: hit.url for i, hit in enumerate(hits)},
    )
