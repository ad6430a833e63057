"""The local search backend (SQLite FTS5) on a real folder of documents, through the browser."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from tools.browser.local_backend import LocalSearchBackend
from tools.browser.server import DEMO_CORPUS
from tools.browser.session import BrowserSession
from tools.servers import start_tool_servers

VOLCANO_HTML = """<!doctype html><html><head><title>Volcanoes of Iceland</title></head>
<body><h1>Volcanoes of Iceland</h1>
<p>Iceland sits on the Mid-Atlantic Ridge, where the Eurasian and North American plates pull
apart. Hekla and Katla are among its most active volcanoes.</p>
<p>For the 2010 ash cloud see <a href="eruptions/eyjafjallajokull.md">the Eyjafjallajökull
eruption</a>; for plates see <a href="https://plates.example.net/ridge">a ridge primer</a>.</p>
</body></html>"""

ERUPTION_MD = """# Eyjafjallajökull eruption

The 2010 eruption of Eyjafjallajökull sent an ash cloud across Europe and closed
airspace for six days, grounding about 100,000 flights.

Back to [the volcano overview](../volcanoes.html).
"""

GLACIER_TXT = """Glaciers cover about eleven percent of Iceland.
Vatnajokull is the largest glacier in Europe by volume.
"""


@pytest.fixture
def library(tmp_path: Path) -> Path:
    (tmp_path / "volcanoes.html").write_text(VOLCANO_HTML)
    (tmp_path / "eruptions").mkdir()
    (tmp_path / "eruptions" / "eyjafjallajokull.md").write_text(ERUPTION_MD)
    (tmp_path / "glaciers.txt").write_text(GLACIER_TXT)
    (tmp_path / "notes.pdf").write_bytes(b"%PDF-1.4 volcano volcano volcano")  # not indexed
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.md").write_text("# Secret volcano\nvolcano volcano")
    (tmp_path / "huge.txt").write_text("volcano " * 200_000)  # over the size limit below
    return tmp_path


def words(text: str) -> int:
    return len(text.split()) + 1


async def test_index_and_search_ranking(library):
    backend = await LocalSearchBackend.open(library, max_file_bytes=100_000)
    assert backend.document_count == 3
    hits = await backend.search("Iceland volcanoes", 10)
    assert [Path(h.url[len("file://") :]).name for h in hits][:1] == ["volcanoes.html"]
    assert hits[0].title == "Volcanoes of Iceland"
    assert hits[0].url == (library / "volcanoes.html").as_uri()
    # Porter stemming: "erupted" finds "eruption"; the snippet shows the matching passage.
    hits = await backend.search("erupted ash", 5)
    assert hits[0].title == "Eyjafjallajökull eruption"
    assert "ash cloud" in hits[0].snippet
    assert await backend.search("glacier", 5) != []
    assert await backend.search("zeppelin", 5) == []
    assert await backend.search("?!  ...", 5) == []
    # FTS5 query syntax in the user's query is just text, never an SQL or FTS error.
    assert await backend.search('"volcano" AND (NEAR OR', 5) != []
    await backend.aclose()


async def test_browse_search_open_follow_links_find_and_cite(library):
    backend = await LocalSearchBackend.open(library)
    session = BrowserSession(backend, count_tokens=words)

    result = await session.call("browser.search", '{"query": "Mid-Atlantic Ridge plates"}')
    assert not result.is_error
    assert "【0†Volcanoes of Iceland】" in result.text  # file: URLs have no domain to show
    volcano_url = (library / "volcanoes.html").as_uri()
    assert result.details["sources"][0]["url"] == volcano_url

    result = await session.call("browser.open", '{"id": 0}')
    assert result.text.startswith(f"[1] Volcanoes of Iceland ({volcano_url})")
    page = session.pages[1]
    eruption_url = (library / "eruptions" / "eyjafjallajokull.md").as_uri()
    assert page.links == {0: eruption_url, 1: "https://plates.example.net/ridge"}
    assert "【1†a ridge primer†plates.example.net】" in page.text

    # Follow a relative link to another local document, and its Markdown link back.
    result = await session.call("browser.open", '{"id": 0}')
    assert not result.is_error, result.text
    assert "grounding about 100,000 flights" in result.text
    assert "【0†the volcano overview】" in session.pages[2].text
    assert session.pages[2].links[0] == volcano_url

    # The web is not reachable from here.
    result = await session.call("browser.open", '{"cursor": 1, "id": 1}')
    assert result.is_error and "not one of the local documents" in result.text

    result = await session.call("browser.find", '{"pattern": "hekla", "cursor": 1}')
    assert "# 【0†match at L" in result.text and "Hekla and Katla" in result.text
    result = await session.call("browser.open", '{"id": 0}')  # a find result opens its page
    assert result.text.startswith("[4] Volcanoes of Iceland")

    answer = "Hekla is active【1†L5-L6】 and the 2010 ash closed airspace【2†L4】."
    text, annotations = session.resolve_citations(answer)
    assert text == (
        f"Hekla is active ([Volcanoes of Iceland]({volcano_url})) and the 2010 ash "
        f"closed airspace ([Eyjafjallajökull eruption]({eruption_url}))."
    )
    assert [(a["url"], a["title"]) for a in annotations] == [
        (volcano_url, "Volcanoes of Iceland"),
        (eruption_url, "Eyjafjallajökull eruption"),
    ]
    for a in annotations:
        assert text[a["start_index"] : a["end_index"]] == f"([{a['title']}]({a['url']}))"
    await backend.aclose()


async def test_fetch_rules(library, tmp_path_factory):
    backend = await LocalSearchBackend.open(library)
    # A file added after indexing, inside the folder, can be opened; one outside cannot.
    (library / "late.md").write_text("# Late\nadded later")
    page = await backend.fetch((library / "late.md").as_uri())
    assert page.title == "Late" and "added later" in page.text
    outside = tmp_path_factory.mktemp("outside") / "x.md"
    outside.write_text("# Outside")
    for url in (outside.as_uri(), "file:///etc/passwd", "https://example.com/"):
        with pytest.raises(Exception, match="not one of the local documents"):
            await backend.fetch(url)
    source = await backend.fetch((library / "volcanoes.html").as_uri(), view_source=True)
    assert "<h1>Volcanoes of Iceland</h1>" in source.text and source.links == {}
    await backend.aclose()


async def test_symlinks_out_of_the_folder_are_neither_indexed_nor_served(library, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.md").write_text("# Zeppelin plans\nzeppelin hangar codes")
    (library / "leak.md").symlink_to(outside / "secret.md")  # a file pointing out
    (library / "linked").symlink_to(outside, target_is_directory=True)  # a folder pointing out
    (library / "alias.txt").symlink_to(library / "glaciers.txt")  # pointing in: fine
    (library / "late.md").write_text("# Late\nadded later")
    backend = await LocalSearchBackend.open(library)
    assert await backend.search("zeppelin hangar", 5) == []
    assert backend.document_count == 6  # the four of the fixture, late.md and alias.txt
    session = BrowserSession(backend, count_tokens=words)
    for path in (library / "leak.md", library / "linked" / "secret.md", outside / "secret.md"):
        result = await session.call("browser.open", json.dumps({"id": path.as_uri()}))
        assert result.is_error and "not one of the local documents" in result.text, result.text
        assert "hangar" not in result.text
    page = await backend.fetch((library / "alias.txt").as_uri())
    assert "Vatnajokull" in page.text
    # A document swapped for a symlink out after it was indexed is not read either.
    (library / "late.md").unlink()
    (library / "late.md").symlink_to(outside / "secret.md")
    result = await session.call("browser.open", json.dumps({"id": (library / "late.md").as_uri()}))
    assert result.is_error and "hangar" not in result.text, result.text
    await backend.aclose()


class LoopWatch:
    """The longest the event loop went without running a 10 ms timer, while it runs."""

    def __init__(self):
        self.longest = 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> float:
        self.task.cancel()
        return self.longest


@pytest.mark.parametrize("kind", ["txt", "html"])
async def test_a_large_file_opens_in_bounded_time_off_the_event_loop(tmp_path, kind):
    """10 MB: its first `max_file_bytes` are shown, with a note; the loop keeps running.
    (Before: the whole file, wrapped on the loop in quadratic time: 98 s for a 10 MB text.)"""
    if kind == "txt":
        (tmp_path / "big.txt").write_text("x" * 10_000_000)  # no space: textwrap's worst case
        limit = 5 << 20
    else:
        paragraph = "<p>Some words and <a href='other.html'>a link</a> in a paragraph.</p>\n"
        (tmp_path / "big.html").write_text("<html><body>" + paragraph * 150_000 + "</body></html>")
        limit = 1 << 20  # (html.parser takes seconds a MB on a busy machine)
    backend = await LocalSearchBackend.open(tmp_path, max_file_bytes=limit)
    assert backend.document_count == 0  # too big to index
    session = BrowserSession(backend, count_tokens=words)
    watch = LoopWatch()
    start = time.monotonic()
    url = (tmp_path / f"big.{kind}").as_uri()
    result = await session.call("browser.open", json.dumps({"id": url}))
    elapsed = time.monotonic() - start
    assert watch.stop() < 0.5 and elapsed < 60, (watch.longest, elapsed)
    assert not result.is_error, result.text
    page = session.pages[-1]
    size = os.path.getsize(tmp_path / f"big.{kind}")
    assert page.text.endswith(f"[The file is {size / 1e6:.1f} MB; only its first {limit / 1e6:.1f} MB are shown.]")
    assert len(page.text) < limit + 1000
    result = await session.call("browser.find", json.dumps({"pattern": "only its first"}))
    assert "match at L" in result.text
    await backend.aclose()


async def test_base_url_names_documents(library):
    backend = await LocalSearchBackend.open(library, base_url="https://docs.example.com/geo")
    hits = await backend.search("Eyjafjallajökull", 3)
    assert hits[0].url == "https://docs.example.com/geo/eruptions/eyjafjallajokull.md"
    page = await backend.fetch(hits[0].url)
    assert page.links[0] == "https://docs.example.com/geo/volcanoes.html"
    await backend.aclose()


async def test_demo_server_with_search_dir_and_bundled_corpus(library, monkeypatch):
    monkeypatch.delenv("EXA_API_KEY", raising=False)
    servers = await start_tool_servers(["browser"], search_dir=library)
    session = servers[0].open_session()
    result = await session.call("browser.search", '{"query": "glacier Europe"}')
    assert "Vatnajokull" in result.text
    assert "sources=local (default: local)" in servers[0].harmony_namespace().description
    await servers[0].aclose()

    # Without a folder or an Exa key, the bundled documents are searched.
    servers = await start_tool_servers(["browser"])
    assert servers[0].backend.folder == DEMO_CORPUS
    result = await servers[0].open_session().call("browser.search", '{"query": "Harmony channels"}')
    assert "【0†The Harmony chat format】" in result.text
    await servers[0].aclose()


async def test_the_demo_corpus_is_the_projects_docs_and_queries_find_different_ones():
    # The bundled corpus was 3 short pages, and every query listed the same 3.
    backend = await LocalSearchBackend.open(DEMO_CORPUS, trusted_links=True)
    names = {Path(url).name for (url,) in backend.db.execute("SELECT url FROM documents")}
    assert {"README.md", "BENCHMARKS.md", "harmony-format.md"} <= names and backend.document_count >= 5
    readme = Path(__file__).resolve().parents[3] / "README.md"
    assert (DEMO_CORPUS / "README.md").read_text() == readme.read_text()

    async def first(query: str) -> str:
        return Path((await backend.search(query, 10))[0].url).name

    assert await first("What is the Harmony format?") == "harmony-format.md"
    assert await first("mixture of experts MXFP4 blocks") == "gpt-oss-models.md"
    assert await first("readiness of the server: /health and /ready") == "README.md"
    assert await first("serving benchmark") in ("README.md", "BENCHMARKS.md")
    # Common words alone do not make every document a hit when the query has others.
    assert len(await backend.search("what is the Harmony format", 10)) < backend.document_count
    assert await backend.search("the", 10) != []  # (a query of nothing else still searches them)
    await backend.aclose()


async def test_a_search_with_no_results_says_so(library):
    backend = await LocalSearchBackend.open(library)
    result = await BrowserSession(backend, count_tokens=words).call("browser.search", '{"query": "zeppelin"}')
    assert not result.is_error and "No results for `zeppelin`." in result.text
    assert result.details["sources"] == []
    await backend.aclose()


def test_an_installed_server_has_the_demo_corpus(tmp_path):
    # The corpus was not package data: a server installed from a wheel had no documents to search.
    import subprocess
    import sys
    import zipfile

    root = Path(__file__).resolve().parents[3]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [wheel] = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        corpus = {
            Path(name).name: archive.read(name)
            for name in archive.namelist()
            if name.startswith("tools/browser/demo_corpus/")
        }
    assert set(corpus) == {path.name for path in DEMO_CORPUS.iterdir()}
    assert corpus["README.md"] == (root / "README.md").read_bytes()  # the file, not a link to it
