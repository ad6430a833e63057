"""Browser citations in a streamed answer (the marks themselves: `tools/browser/citations.py`).

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

from tools.browser.citations import PUNCTUATION_AFTER_A_MARK, UNFINISHED_AT_END

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
    """Feeds an answer's deltas through the browser's resolver, one mark at a time, so that the
    streamed text and annotations equal what resolving the whole answer at once gives. Spaces
    are held until the next character: a link the resolver writes brings its own space, and an
    unresolvable mark takes the spaces before it when punctuation or the end follows it."""

    def __init__(self, resolve: Callable[[str], tuple[str, list[Any]]] | None):
        self.resolve = resolve
        self.pending = ""  # an open mark waiting for its 】
        self.held = ""  # spaces after the released text, not released yet
        self.after_removed_mark = False  # an unresolvable mark was removed right after `held`
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
                    if len(chunk.citations) == 1 and chunk.citations[0].url == self.last_url:
                        self.held = ""  # the same source cited again right away: it, and the space before it, go
                        continue
                    if not chunk.text:  # an unresolvable mark, removed
                        self.after_removed_mark = True
                        continue
                    if chunk.citations and chunk.text.startswith(" ") and (self.held or self.after_space):
                        # The resolver saw the mark alone, so it put a space before the link;
                        # the text before it already ends in one.
                        chunk = CitedChunk(
                            chunk.text[1:],
                            [Citation(c.url, c.title, c.start_index - 1, c.end_index - 1) for c in chunk.citations],
                        )
                    if self.held:
                        chunks.append(CitedChunk(self._release_held()))
                    if chunk.citations:
                        self.last_url = chunk.citations[-1].url
                    elif chunk.text.strip():
                        self.last_url = None
                    chunks.append(chunk)
                    self.after_space = chunk.text[-1].isspace()
                elif len(self.pending) > MAX_MARK_CHARS:
                    plain += self._release_held() + self.pending
                    self.pending = ""
                    self.after_space = char.isspace()
            elif char == OPEN:
                self.pending = char
            else:
                if self.after_removed_mark:
                    if char.isspace() or char in PUNCTUATION_AFTER_A_MARK:
                        self.held = ""  # "fact 【9†L1】." -> "fact.", as the resolver writes it
                    self.after_removed_mark = False
                if char == " ":
                    self.held += char
                    continue
                plain += self._release_held() + char
                self.after_space = char.isspace()
                if not char.isspace():
                    self.last_url = None
        if plain:
            chunks.append(CitedChunk(plain))
        return chunks

    def flush(self) -> list[CitedChunk]:
        rest, self.pending = self.pending, ""
        if self.resolve is not None and UNFINISHED_AT_END.fullmatch(rest):
            rest = ""  # the answer ended inside a citation mark
        held = "" if self.after_removed_mark else self._release_held()
        self.held = ""
        return [CitedChunk(held + rest)] if held + rest else []

    def _release_held(self) -> str:
        held, self.held = self.held, ""
        if held:
            self.after_space = True
        return held

    def _resolved(self, mark: str) -> CitedChunk:
        try:
            text, annotations = self.resolve(mark)
        except Exception:  # a citation we cannot resolve stays as the model wrote it
            return CitedChunk(mark)
        citations = [c for c in (as_citation(a) for a in annotations or []) if c is not None]
        return CitedChunk(text, citations)
