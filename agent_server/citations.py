"""Browser citations in a streamed answer.

gpt-oss cites what it read as `【{cursor}†L{start}-L{end}】`. The browser session knows which
page each cursor was; `resolve_citations(text) -> (text, annotations)` rewrites the marks and
says where the cited spans are. Deltas arrive a few characters at a time, so a mark is held
back until it closes (or clearly is not one), then resolved and released with its
annotations, their offsets shifted to the answer's running length.

Two rules of the browser's resolver need more than one mark's context, so they live here: a
citation of the same URL as the link just before it (only whitespace between) is dropped, and
an unfinished mark when the answer ends is removed rather than shown raw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tools.browser.citations import UNFINISHED_AT_END

OPEN, CLOSE = "【", "】"
MAX_MARK_CHARS = 64  # a longer "mark" is just text that happens to contain 【


@dataclass
class Citation:
    url: str
    title: str
    start_index: int  # characters, in the text the chunk belongs to
    end_index: int


@dataclass
class CitedChunk:
    text: str
    citations: list[Citation] = field(default_factory=list)  # offsets relative to this chunk


def _field(annotation: Any, name: str, default: Any = None) -> Any:
    if isinstance(annotation, dict):
        return annotation.get(name, default)
    return getattr(annotation, name, default)


def as_citation(annotation: Any) -> Citation | None:
    url = _field(annotation, "url")
    if not url:
        return None
    return Citation(
        url=url,
        title=_field(annotation, "title") or url,
        start_index=int(_field(annotation, "start_index", 0)),
        end_index=int(_field(annotation, "end_index", 0)),
    )


class CitationStreamer:
    def __init__(self, resolve: Callable[[str], tuple[str, list[Any]]] | None):
        self.resolve = resolve
        self.pending = ""  # an open mark waiting for its 】
        self.last_url: str | None = None  # the last link's URL, while only whitespace followed it
        self.after_space = False  # the text released so far ends in whitespace

    def feed(self, text: str) -> list[CitedChunk]:
        if self.resolve is None:
            return [CitedChunk(text)] if text else []
        chunks: list[CitedChunk] = []
        plain = ""
        for char in text:
            if self.pending:
                self.pending += char
                if char == CLOSE:
                    if plain:
                        chunks.append(CitedChunk(plain))
                        plain = ""
                    chunk = self._resolved(self.pending)
                    self.pending = ""
                    if chunk.citations and chunk.text.startswith(" ") and self.after_space:
                        # The resolver saw the mark alone, so it put a space before the link;
                        # the text before it already ends in one.
                        chunk = CitedChunk(chunk.text[1:], [
                            Citation(c.url, c.title, c.start_index - 1, c.end_index - 1)
                            for c in chunk.citations])
                    if len(chunk.citations) == 1 and chunk.citations[0].url == self.last_url:
                        continue  # the same source cited again right away
                    if chunk.citations:
                        self.last_url = chunk.citations[-1].url
                    elif chunk.text.strip():
                        self.last_url = None
                    chunks.append(chunk)
                    if chunk.text:
                        self.after_space = chunk.text[-1].isspace()
                elif len(self.pending) > MAX_MARK_CHARS:
                    plain += self.pending
                    self.pending = ""
                    self.after_space = char.isspace()
            elif char == OPEN:
                self.pending = char
            else:
                plain += char
                self.after_space = char.isspace()
                if not char.isspace():
                    self.last_url = None
        if plain:
            chunks.append(CitedChunk(plain))
        return chunks

    def flush(self) -> list[CitedChunk]:
        rest, self.pending = self.pending, ""
        if self.resolve is not None and UNFINISHED_AT_END.fullmatch(rest):
            return []  # the answer ended inside a citation mark
        return [CitedChunk(rest)] if rest else []

    def _resolved(self, mark: str) -> CitedChunk:
        try:
            text, annotations = self.resolve(mark)
        except Exception:  # a citation we cannot resolve stays as the model wrote it
            return CitedChunk(mark)
        citations = [c for c in (as_citation(a) for a in annotations or []) if c is not None]
        return CitedChunk(text, citations)
