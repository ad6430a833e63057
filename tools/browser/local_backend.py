"""Search over a local folder of documents, for air-gapped use (`--search-dir DIR`).

Text (`.txt`, `.rst`), Markdown (`.md`) and HTML (`.html`, `.htm`) files under the folder are
indexed at start into an in-memory SQLite FTS5 table (Porter-stemmed words, BM25 ranking with
titles weighted up). Each document's URL is its `file://` URI, or `base_url` + its relative
path when given, so citations point somewhere meaningful. Links between the documents work:
relative links resolve to other documents' URLs, which `fetch` finds in the index. Nothing
outside the folder is reachable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

from tools.browser.backend import BackendError
from tools.browser.documents import SearchHit, page_from_html, page_from_markdown, page_from_text, source_page
from tools.browser.html_text import html_to_text
from tools.browser.page import Page, strip_links

logger = logging.getLogger(__name__)

KINDS = {".txt": "text", ".text": "text", ".rst": "text", ".md": "markdown",
         ".markdown": "markdown", ".html": "html", ".htm": "html"}
WORD = re.compile(r"\w+", re.UNICODE)
SCHEMA = """
CREATE TABLE documents (id INTEGER PRIMARY KEY, url TEXT UNIQUE, path TEXT, kind TEXT, title TEXT);
CREATE VIRTUAL TABLE passages USING fts5(title, body, tokenize = 'porter unicode61');
"""


@dataclass
class _Document:
    url: str
    path: Path
    kind: str
    title: str


class LocalSearchBackend:
    source_name = "local"

    def __init__(self, folder: str | os.PathLike, *, base_url: str | None = None,
                 max_file_bytes: int = 5 << 20):
        self.folder = Path(folder).resolve()
        if not self.folder.is_dir():
            raise ValueError(f"search folder {self.folder} is not a directory")
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
                raw = path.read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                logger.warning("skipping %s: %s", path, e)
                continue
            document = _Document(self.url_for(path), path, KINDS[path.suffix.lower()], "")
            page = self._page(document, raw)
            rows.append((document.url, str(path), document.kind, page.title,
                         strip_links(page.text)))
        with self.lock:
            self.db.execute("DELETE FROM documents")
            self.db.execute("DELETE FROM passages")
            for i, (url, path, kind, title, body) in enumerate(rows, start=1):
                self.db.execute("INSERT INTO documents VALUES (?, ?, ?, ?, ?)",
                                (i, url, path, kind, title))
                self.db.execute("INSERT INTO passages (rowid, title, body) VALUES (?, ?, ?)",
                                (i, title, body))
            self.db.commit()
            self.document_count = len(rows)
        logger.info("indexed %d documents under %s", len(rows), self.folder)

    def _files(self):
        for root, dirs, files in os.walk(self.folder):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                path = Path(root) / name
                if name.startswith(".") or path.suffix.lower() not in KINDS:
                    continue
                try:
                    if path.stat().st_size <= self.max_file_bytes:
                        yield path
                except OSError:
                    continue

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
        terms = WORD.findall(query.lower())
        if not terms:
            return []
        match = " OR ".join(f'"{term}"' for term in terms)
        rows = await asyncio.to_thread(self._query, match, topn)
        return [SearchHit(url=url, title=title, snippet=snippet) for url, title, snippet in rows]

    def _query(self, match: str, topn: int) -> list[tuple[str, str, str]]:
        with self.lock:
            return self.db.execute(
                "SELECT d.url, d.title, snippet(passages, 1, '', '', ' … ', 40) "
                "FROM passages JOIN documents d ON d.id = passages.rowid "
                "WHERE passages MATCH ? ORDER BY bm25(passages, 5.0, 1.0) LIMIT ?",
                (match, topn),
            ).fetchall()

    def _lookup(self, url: str) -> _Document | None:
        with self.lock:
            row = self.db.execute("SELECT url, path, kind, title FROM documents WHERE url = ?",
                                  (url.split("#")[0],)).fetchone()
        if row is not None:
            return _Document(row[0], Path(row[1]), row[2], row[3])
        # A file under the folder added after indexing.
        parsed = urlparse(url)
        if parsed.scheme == "file":
            path = Path(unquote(parsed.path)).resolve()
            if (path.is_relative_to(self.folder) and path.is_file()
                    and path.suffix.lower() in KINDS):
                return _Document(self.url_for(path), path, KINDS[path.suffix.lower()], "")
        return None

    async def fetch(self, url: str, *, view_source: bool = False) -> Page:
        document = self._lookup(url)
        if document is None:
            raise BackendError(f"`{url}` is not one of the local documents (this browser has no "
                               f"internet access; use search to find documents)")
        try:
            raw = await asyncio.to_thread(document.path.read_text, encoding="utf-8",
                                          errors="replace")
        except OSError as e:
            raise BackendError(f"cannot read {document.path.name}: {e.strerror}") from e
        if view_source:
            return source_page(raw, document.url, document.title or None)
        return self._page(document, raw)

    async def aclose(self) -> None:
        with self.lock:
            self.db.close()
