"""HTML to the browser's page text: Markdown-like blocks, link markers, image placeholders.

Headings become `# ...`, list items `  * ...`, table cells are joined with ` | `, scripts,
styles and other invisible parts are dropped. Each `<a href>` becomes a numbered link marker
(`page.link_marker`); images become `[Image n: alt]`. Built on the standard library's
`html.parser`, which tolerates fragments and broken markup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from urllib.parse import urljoin, urlparse

from tools.browser.page import clean_text, domain_of, link_marker

INVISIBLE = {"script", "style", "noscript", "template", "svg", "math", "iframe", "object", "select", "button"}
PARAGRAPHS = {
    "p",
    "pre",
    "blockquote",
    "table",
    "ul",
    "ol",
    "dl",
    "figure",
    "hr",
    "section",
    "article",
    "header",
    "footer",
    "main",
    "nav",
    "aside",
    "form",
    "fieldset",
    "address",
    "details",
}
LINES = {"div", "tr", "li", "dt", "dd", "caption", "figcaption", "summary", "br", "thead", "tbody", "tfoot"}
HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
UNLINKABLE = ("#", "javascript:", "mailto:", "tel:", "data:")
WHITESPACE = re.compile(r"\s+")


@dataclass
class HtmlText:
    title: str
    text: str
    links: dict[int, str] = field(default_factory=dict)


class _Converter(HTMLParser):
    def __init__(self, base_url: str):
        super().__init__(convert_charrefs=True)
        self.base_url = base_url
        self.page_domain = domain_of(base_url) if base_url else ""
        self.out: list[str] = []
        self.pending_breaks = 0  # newlines owed before the next text
        self.prefix = ""  # written right after those newlines (heading hashes, list bullets)
        self.invisible_depth = 0
        self.pre_depth = 0
        self.title_parts: list[str] | None = None
        self.title = ""
        self.link: tuple[str, list[str]] | None = None  # href and the text inside the <a>
        self.link_space = False  # a block broke the link's text: a space before its next text
        self.links: dict[int, str] = {}
        self.link_ids: dict[str, int] = {}
        self.images = 0
        self.lists: list[int | None] = []  # per open list: next number (ol) or None (ul)
        self.row_cells = 0

    # -- writing

    def _in_link_text(self) -> bool:
        return self.link is not None and bool(self.link[1])

    def _break(self, newlines: int) -> None:
        if self._in_link_text():  # a link wrapping blocks (a card, a <br>): one line of link text
            self.link_space = True
            return
        self.pending_breaks = max(self.pending_breaks, newlines)

    def _write(self, text: str) -> None:
        if self.link is not None:
            if self.link_space and self.link[1]:
                self.link[1].append(" ")
            self.link_space = False
            self.link[1].append(text)
            return
        if not self.pre_depth:
            text = WHITESPACE.sub(" ", text)
            at_line_start = self.pending_breaks or not self.out or self.out[-1].endswith((" ", "\n"))
            if at_line_start:
                text = text.lstrip(" ")
            if not text:
                return
        if self.out and self.pending_breaks:
            self.out.append("\n" * self.pending_breaks)
        if self.pending_breaks or not self.out:
            text = self.prefix + text
            self.prefix = ""
        self.pending_breaks = 0
        self.out.append(text)

    # -- parser callbacks

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in INVISIBLE:
            self.invisible_depth += 1
            return
        if self.invisible_depth:
            return
        attributes = {k: v or "" for k, v in attrs}
        prefix = self.prefix
        self._start_block(tag, attributes)
        if self._in_link_text():  # (a heading or list item inside a link: no prefix mid-line)
            self.prefix = prefix

    def _start_block(self, tag: str, attributes: dict[str, str]) -> None:
        if tag == "title":
            self.title_parts = []
        elif tag in HEADINGS:
            self._break(2)
            self.prefix = "#" * HEADINGS[tag] + " "
        elif tag in ("ul", "ol"):
            self.lists.append(1 if tag == "ol" else None)
            self._break(2 if len(self.lists) == 1 else 1)
        elif tag == "li":
            self._break(1)
            indent = "  " * len(self.lists or [None])
            number = self.lists[-1] if self.lists else None
            if number is None:
                self.prefix = f"{indent}* "
            else:
                self.prefix = f"{indent}{number}. "
                self.lists[-1] = number + 1
        elif tag == "tr":
            self._break(1)
            self.row_cells = 0
        elif tag in ("td", "th"):
            if self.row_cells:
                self._write(" | ")
            self.row_cells += 1
        elif tag == "pre":
            self._break(2)
            self.pre_depth += 1
        elif tag == "br":
            self._break(1)
        elif tag == "img":
            alt = " ".join((attributes.get("alt") or attributes.get("title") or "").split())
            self._write(f"[Image {self.images}: {alt}]" if alt else f"[Image {self.images}]")
            self.images += 1
        elif tag == "a" and "href" in attributes:
            self._close_link()
            self.link = (attributes["href"].strip(), [])
        elif tag in PARAGRAPHS:
            self._break(2)
        elif tag in LINES:
            self._break(1)

    def handle_endtag(self, tag: str) -> None:
        if tag in INVISIBLE:
            self.invisible_depth = max(0, self.invisible_depth - 1)
            return
        if self.invisible_depth:
            return
        if tag == "title" and self.title_parts is not None:
            self.title = " ".join(" ".join(self.title_parts).split())
            self.title_parts = None
        elif tag == "a":
            self._close_link()
        elif tag in ("ul", "ol"):
            if self.lists:
                self.lists.pop()
            self._break(2 if not self.lists else 1)
        elif tag == "pre":
            self.pre_depth = max(0, self.pre_depth - 1)
            self._break(2)
        elif tag in HEADINGS or tag in PARAGRAPHS:
            self._break(2)
        elif tag in LINES:
            self._break(1)

    def handle_data(self, data: str) -> None:
        if self.invisible_depth:
            return
        if self.title_parts is not None:
            self.title_parts.append(data)
            return
        self._write(clean_text(data))

    def _close_link(self) -> None:
        if self.link is None:
            return
        href, parts = self.link
        self.link = None
        text = " ".join("".join(parts).split())
        url = self._resolve(href)
        if not text or url is None:
            self._write(text)
            return
        link_id = self.link_ids.get(url)
        if link_id is None:
            link_id = self.link_ids[url] = len(self.links)
            self.links[link_id] = url
        self._write(link_marker(link_id, text, url, self.page_domain))

    def _resolve(self, href: str) -> str | None:
        if not href or href.lower().startswith(UNLINKABLE):
            return None
        url = urljoin(self.base_url, href) if self.base_url else href
        parsed = urlparse(url)
        if parsed.scheme in ("http", "https") and parsed.netloc:
            return url
        if parsed.scheme == "file":
            return url
        return None

    def result(self) -> HtmlText:
        self._close_link()
        text = "".join(self.out)
        lines = [line.rstrip() for line in text.split("\n")]
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
        return HtmlText(title=self.title, text=text, links=self.links)


def html_to_text(html: str, base_url: str = "") -> HtmlText:
    """Convert an HTML document or fragment; relative links resolve against `base_url`."""
    converter = _Converter(base_url)
    converter.feed(html)
    converter.close()
    return converter.result()
