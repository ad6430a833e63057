"""Search over a local folder of documents, for air-gapped use (`--search-dir DIR`).

Text (`.txt`, `.rst`), Markdown (`.md`) and HTML (`.html`, `.htm`) files under the folder are
indexed at start into an in-memory SQLite FTS5 table (Porter-stemmed words, BM25 ranking with
titles weighted up), one row per section (a heading and what follows it, cut at about
`SECTION_CHARS`): a long document is then found by the part that matches, not drowned out or
lifted by its length. A search lists each document once, with its best section's snippet, and
ignores common English words when the query has others (so "what is the Harmony format" is about
Harmony, not about every document holding "the"). Each document's URL is its `file://` URI, or `base_url` + its relative
path when given, so citations point somewhere meaningful. Links between the documents work:
relative links resolve to other documents' URLs, which `fetch` finds in the index.

Nothing outside the folder is reachable: every path is resolved (symlinks included) and must
stay under the folder, both when indexing and when a document is read, and hidden files and
folders are left out. A file is read up to `max_file_bytes` (larger ones are not indexed, and
open shows their beginning), and turned into a page in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sqlite3
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

from tools.browser.backend import BackendError
from tools.browser.documents import SearchHit, page_from_html, page_from_markdown, page_from_text, source_page
from tools.browser.html_text import html_to_text
from tools.browser.page import Page, strip_links

logger = logging.getLogger(__name__)

KINDS = {
    ".txt": "text",
    ".text": "text",
    ".rst": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
}
WORD = re.compile(r"\w+", re.UNICODE)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
SECTION_CHARS = 3000
STOP_WORDS = frozenset(
    """
a about an and are as at be by can could did do does for from had has have how i if in into is it its
me my no not of on or our should so than that the their them then there these they this those to
was we were what when where which who whom why will with would you your
""".split()
)
SCHEMA = """
CREATE TABLE documents (id INTEGER PRIMARY KEY, url TEXT UNIQUE, path TEXT, kind TEXT, title TEXT);
CREATE VIRTUAL TABLE passages USING fts5(title, body, document UNINDEXED, tokenize = 'porter unicode61');
"""


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, text) for each section of a page's text: a new one at each heading line, and
    at a paragraph break once one passes SECTION_CHARS."""
    found: list[tuple[str, list[str]]] = [("", [])]
    size = 0
    for line in text.split("\n"):
        heading = HEADING.match(line)
        if heading or (size > SECTION_CHARS and not line.strip()):
            found.append((heading.group(1) if heading else found[-1][0], []))
            size = 0
        found[-1][1].append(line)
        size += len(line) + 1
    return [(heading, "\n".join(lines)) for heading, lines in found if "\n".join(lines).strip()]


def match_expression(query: str) -> str | None:
    """The FTS5 query for a user's words: any of them (each quoted, so no word is FTS syntax),
    common words left out unless there is nothing else."""
    terms = list(dict.fromkeys(WORD.findall(query.lower())))
    meaningful = [t for t in terms if t not in STOP_WORDS] or terms
    return " OR ".join(f'"{term}"' for term in meaningful) or None


@dataclass
class _Document:
    url: str
    path: Path
    kind: str
    title: str


class LocalSearchBackend:
    source_name = "local"

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        base_url: str | None = None,
        max_file_bytes: int = 5 << 20,
        trusted_links: bool = False,
    ):
        """`trusted_links`: the folder is one this project ships (the demo corpus), whose own
        symlinks may lead out of it (to the repository's docs): their targets are served too.
        A user's folder never gets this."""
        self.folder = Path(folder).resolve()
        if not self.folder.is_dir():
            raise ValueError(f"search folder {self.folder} is not a directory")
        self.linked_files: set[Path] = set()
        if trusted_links:
            self.linked_files = {
                entry.resolve() for entry in self.folder.iterdir() if entry.is_symlink() and entry.resolve().is_file()
            }
        self.base_url = base_url.rstrip("/") + "/" if base_url else None
        self.max_file_bytes = max_file_bytes
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()
        self.document_count = 0

    @classmethod
    async def open(cls, folder: str | os.PathLike, **options) -> LocalSearchBackend:
        """A backend with the folder indexed (in a thread: reading files blocks)."""
        backend = cls(folder, **options)
        await asyncio.to_thread(backend.build_index)
        return backend

    # -- indexing

    def url_for(self, path: Path) -> str:
        if self.base_url:
            return self.base_url + quote(path.relative_to(self.folder).as_posix())
        return path.as_uri()

    def build_index(self) -> None:
        rows = []
        for path in sorted(self._files()):
            try:
                raw, _ = self._read(path)
            except OSError as e:
                logger.warning("skipping %s: %s", path, e)
                continue
            document = _Document(self.url_for(path), path, KINDS[path.suffix.lower()], "")
            page = self._page(document, raw)
            rows.append((document.url, str(path), document.kind, page.title, sections(strip_links(page.text))))
        with self.lock:
            self.db.execute("DELETE FROM documents")
            self.db.execute("DELETE FROM passages")
            for i, (url, path, kind, title, parts) in enumerate(rows, start=1):
                self.db.execute("INSERT INTO documents VALUES (?, ?, ?, ?, ?)", (i, url, path, kind, title))
                for heading, body in parts:  # (a section's heading counts as part of its title)
                    self.db.execute(
                        "INSERT INTO passages (title, body, document) VALUES (?, ?, ?)",
                        (f"{title} {heading}" if heading and heading != title else title, body, i),
                    )
            self.db.commit()
            self.document_count = len(rows)
        logger.info("indexed %d documents under %s", len(rows), self.folder)

    def _files(self):
        for root, dirs, files in os.walk(self.folder):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                path = Path(root) / name
                resolved = self._servable(path)
                if resolved is not None and resolved.stat().st_size <= self.max_file_bytes:
                    yield path

    def _servable(self, path: Path) -> Path | None:
        """`path` resolved, if it is a document of the folder: a regular file under the folder
        once every symlink is followed, not hidden, of a kind we read."""
        if path.suffix.lower() not in KINDS:
            return None
        try:
            relative = path.relative_to(self.folder)
            resolved = path.resolve(strict=True)
            info = resolved.stat()
        except (OSError, ValueError, RuntimeError):  # (RuntimeError: a symlink loop)
            return None
        if (
            not self._inside(resolved)
            or not stat.S_ISREG(info.st_mode)
            or any(part.startswith(".") for part in relative.parts)
        ):
            return None
        return resolved

    def _page(self, document: _Document, raw: str) -> Page:
        fallback_title = document.path.stem.replace("_", " ").replace("-", " ")
        if document.kind == "html":
            title = html_to_text(raw[:20000]).title or fallback_title
            return page_from_html(raw, document.url, title)
        if document.kind == "markdown":
            page = page_from_markdown(raw, document.url)
            if page.title == document.url:
                page.title = fallback_title
            return page
        return page_from_text(raw, document.url, fallback_title)

    # -- the backend interface

    async def search(self, query: str, topn: int) -> list[SearchHit]:
        match = match_expression(query)
        if match is None:
            return []
        rows = await asyncio.to_thread(self._query, match, topn)
        return [SearchHit(url=url, title=title, snippet=snippet) for url, title, snippet in rows]

    def _query(self, match: str, topn: int) -> list[tuple[str, str, str]]:
        """The best-ranked section of each of the `topn` best documents."""
        best: dict[str, tuple[str, str, str]] = {}
        with self.lock:
            sections = self.db.execute(
                "SELECT d.url, d.title, snippet(passages, 1, '', '', ' … ', 40) "
                "FROM passages JOIN documents d ON d.id = passages.document "
                "WHERE passages MATCH ? ORDER BY bm25(passages, 5.0, 1.0)",
                (match,),
            )
            for url, title, snippet in sections:
                best.setdefault(url, (url, title, snippet))
                if len(best) == topn:
                    break
        return list(best.values())

    def _lookup(self, url: str) -> _Document | None:
        with self.lock:
            row = self.db.execute(
                "SELECT url, path, kind, title FROM documents WHERE url = ?", (url.split("#")[0],)
            ).fetchone()
        if row is not None:
            return _Document(row[0], Path(row[1]), row[2], row[3])
        # A file under the folder added after indexing.
        parsed = urlparse(url)
        if parsed.scheme == "file":
            path = Path(os.path.normpath(unquote(parsed.path)))
            if self._inside(path) and self._servable(path) is not None:
                return _Document(self.url_for(path), path, KINDS[path.suffix.lower()], "")
        return None

    def _inside(self, resolved: Path) -> bool:
        """Whether a resolved path is one this backend may serve: under the folder, or a file
        the shipped corpus links to."""
        return resolved.is_relative_to(self.folder) or resolved in self.linked_files

    def _read(self, path: Path) -> tuple[str, int | None]:
        """The text of the document at `path`, checked again as it is opened (the folder may
        have changed since it was indexed), and its size in bytes when it is over the limit
        (then the text is its first `max_file_bytes`)."""
        resolved = path.resolve(strict=True)
        if not self._inside(resolved):
            raise PermissionError(f"{path.name} leads outside the search folder")
        # O_NOFOLLOW|O_NONBLOCK: a last component swapped for a symlink or a FIFO since the
        # check fails instead of leading elsewhere or blocking.
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            try:  # where the file opened really is (a folder on the way may have been swapped)
                opened = Path(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                opened = resolved
            if not stat.S_ISREG(info.st_mode) or not self._inside(opened):
                raise PermissionError(f"{path.name} is not a file of the search folder")
            data = f.read(self.max_file_bytes + 1)
        if len(data) <= self.max_file_bytes:
            return data.decode("utf-8", errors="replace"), None
        cut = self.max_file_bytes
        while cut > self.max_file_bytes - 4 and data[cut] & 0xC0 == 0x80:
            cut -= 1  # (back to the start of a UTF-8 character cut at the limit)
        return data[:cut].decode("utf-8", errors="replace"), max(info.st_size, len(data))

    def _load(self, document: _Document, view_source: bool) -> Page:
        """Read and convert a document (run in a thread: both can take seconds for big files)."""
        raw, size = self._read(document.path)
        if view_source:
            page = source_page(raw, document.url, document.title or None)
        else:
            page = self._page(document, raw)
        if size is not None:
            page.text += (
                f"\n\n[The file is {size / 1e6:.1f} MB; only its first {self.max_file_bytes / 1e6:.1f} MB are shown.]"
            )
        page.lines  # noqa: B018 - wrapped here, off the event loop
        return page

    async def fetch(self, url: str, *, view_source: bool = False) -> Page:
        document = self._lookup(url)
        if document is None:
            raise BackendError(
                f"`{url}` is not one of the local documents (this browser has no "
                f"internet access; use search to find documents)"
            )
        try:
            return await asyncio.to_thread(self._load, document, view_source)
        except OSError as e:
            raise BackendError(f"cannot read {document.path.name}: {e.strerror or e}") from e

    async def aclose(self) -> None:
        with self.lock:
            self.db.close()
