"""The browser's page model, formats, page stack, errors and citation mapping."""

from __future__ import annotations

import json

import pytest

from inference.tokenizer import harmony_encoding
from tools.browser.backend import BackendError
from tools.browser.citations import resolve_citations
from tools.browser.documents import SearchHit, page_from_html, page_from_markdown, search_results_page
from tools.browser.html_text import html_to_text
from tools.browser.page import Page, find_in_page, render_window, strip_links, wrap_lines
from tools.browser.server import BrowserToolServer
from tools.browser.session import BrowserSession
from tools.protocol import ToolResult, ToolSessionGroup


def words(text: str) -> int:
    return len(text.split()) + 1


LONG_PAGE_URL = "https://docs.example.com/long"


class MemoryBackend:
    """Pages and search results from dicts; records what was asked."""

    source_name = "memory"

    def __init__(self):
        self.fetched: list[str] = []
        self.hits = [
            SearchHit(LONG_PAGE_URL, "A long page", "Lines and lines."),
            SearchHit("https://other.example.org/x", "Other page", "Another one."),
        ]
        paragraphs = "".join(f"<p>Paragraph {i} says {'word ' * 12}{i}.</p>" for i in range(60))
        self.pages = {
            LONG_PAGE_URL: f"<title>A long page</title><h1>Long</h1>{paragraphs}"
            f"<p>The needle is <a href='/next'>here</a>.</p>",
            "https://other.example.org/x": "<title>Other page</title><p>Tiny.</p>",
            "https://docs.example.com/next": "<title>Next</title><p>Next page.</p>",
        }

    async def search(self, query: str, topn: int) -> list[SearchHit]:
        if query == "explode":
            raise RuntimeError("backend exploded")
        return self.hits[:topn]

    async def fetch(self, url: str, *, view_source: bool = False) -> Page:
        self.fetched.append(url)
        if url not in self.pages:
            raise BackendError("404 Not Found")
        return page_from_html(self.pages[url], url)

    async def aclose(self) -> None:
        pass


@pytest.fixture
def session() -> BrowserSession:
    return BrowserSession(MemoryBackend(), view_tokens=200, count_tokens=words)


async def call(session: BrowserSession, recipient: str, **args) -> ToolResult:
    return await session.call(recipient, json.dumps(args))


def test_search_results_page_format():
    page = search_results_page(
        "what is up",
        [
            SearchHit("https://a.example.com/1", "First 【fake】 title", "Snippet\n  one."),
            SearchHit("https://b.example.org/2", "Second†title", ""),
        ],
    )
    text = render_window(page, cursor=3, loc=0, num_lines=-1, view_tokens=1000, count_tokens=words)
    assert text == (
        "[3] what is up\n"
        "**viewing lines [0 - 5] of 5**\n\n"
        "L0: \n"
        "L1: URL: \n"
        "L2: # Search Results\n"
        "L3: \n"
        "L4:   * 【0†First 〖fake〗 title†a.example.com】 Snippet one.\n"
        "L5:   * 【1†Second‡title†b.example.org】"
    )
    assert page.links == {0: "https://a.example.com/1", 1: "https://b.example.org/2"}


def test_html_conversion():
    html = """<html><head><title> The  Title </title><style>p {color: red}</style></head>
    <body><h2>Section &amp; more</h2><p>Some <b>bold</b>
    text with a <a href="/rel">relative link</a>, an <a href="https://else.org/x">external
    one</a>, the <a href="/rel">same link again</a>, <a href="#top">an anchor</a> and
    <a href="mailto:a@b.c">mail</a>.</p>
    <ul><li>one</li><li>two <img alt="a cat" src="c.png"></li></ul><ol><li>first</li></ol>
    <table><tr><th>k</th><th>v</th></tr><tr><td>a</td><td>1</td></tr></table>
    <pre>  keep   spacing
  here</pre><script>alert("no")</script><p>Fake 【9†marker】 stays text.</p></body></html>"""
    converted = html_to_text(html, base_url="https://site.example.com/dir/page.html")
    assert converted.title == "The Title"
    assert converted.text == (
        "## Section & more\n\n"
        "Some bold text with a 【0†relative link】, an 【1†external one†else.org】, the "
        "【0†same link again】, an anchor and mail.\n\n"
        "  * one\n"
        "  * two [Image 0: a cat]\n\n"
        "  1. first\n\n"
        "k | v\n"
        "a | 1\n\n"
        "  keep   spacing\n  here\n\n"
        "Fake 〖9†marker〗 stays text."
    )
    assert converted.links == {0: "https://site.example.com/rel", 1: "https://else.org/x"}


def test_markdown_pages_reflow_paragraphs_and_link():
    page = page_from_markdown(
        "# Title\n\nA paragraph that was\nhard wrapped [here](other.md).\n\n- item\n- item 2\n\n"
        "```\ncode\n  block\n```\n![logo](logo.png)",
        "file:///docs/a.md",
    )
    assert page.title == "Title"
    assert page.text == (
        "\nURL: file:///docs/a.md\n# Title\n\n"
        "A paragraph that was hard wrapped 【0†here】.\n\n- item\n- item 2\n\n"
        "```\ncode\n  block\n```\n[Image 0: logo]"
    )
    assert page.links == {0: "file:///docs/other.md"}


def test_wrapping_and_link_stripping():
    assert wrap_lines("x" * 170 + "\n\nshort") == ["x" * 80, "x" * 80, "x" * 10, "", "short"]
    assert strip_links("see 【3†the docs†a.com】 and 【4†more】") == "see the docs and more"
    assert strip_links("ident】 tail and head 【7†cut") == " tail and head cut"
    # A marker wrapped inside its domain keeps the line break: find's line numbers count lines.
    assert strip_links("a 【1†ref†my-very-\nlong.org】 b\nc") == "a ref\n b\nc"


def test_wrapping_matches_textwrap_in_linear_time():
    """The lines are textwrap's (the reference browser's), for every mix of words, spaces,
    tabs, hyphens and runs longer than a line; and a run of several MB without a space, which
    textwrap wraps in quadratic time (10 MB took minutes), wraps in well under a second a MB."""
    import random
    import textwrap
    import time

    def reference(text: str, width: int) -> list[str]:
        return [
            wrapped
            for line in text.split("\n")
            for wrapped in (textwrap.wrap(line, width=width, replace_whitespace=False, drop_whitespace=False) or [""])
        ]

    pieces = [
        "a",
        "word",
        " ",
        "  ",
        "\t",
        "-",
        "--",
        "re-use",
        "x" * 90,
        "y" * 30 + "-" + "z" * 70,
        "-" * 85,
        "a-" * 50,
        "\u00e9",
        "\u00a0",
        "\x0b",
        "\n",
        ".",
    ]
    rng = random.Random(45)
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(60)))
        for width in (80, 9):
            assert wrap_lines(text, width) == reference(text, width), (text, width)
    start = time.monotonic()
    assert wrap_lines("x" * 3_000_000) == ["x" * 80] * 37_500
    assert time.monotonic() - start < 3  # textwrap: about 6 s here, and 4x that for twice the size


def test_find_line_numbers_after_a_link_wrapped_in_its_domain():
    html = (
        "<p>" + "x" * 60 + " <a href='https://my-very-long-subdomain.another-example.org/page'>ref</a>"
        " tail</p><p>line one</p><p>NEEDLE here</p>"
    )
    page = page_from_html(html, "https://a.example.com/p")
    assert any("【" in line and "】" not in line for line in page.lines)  # the marker is wrapped
    actual = next(i for i, line in enumerate(page.lines) if "NEEDLE" in line)
    assert find_in_page(page, "NEEDLE").result_lines == {0: actual}


@pytest.mark.parametrize(
    "html, text",
    [
        (
            "<a href='https://e.com/story'><h3>Big headline</h3><p>Short summary</p></a><p>next</p>",
            "### 【0†Big headline Short summary】\n\nnext",
        ),
        ("<p><a href='https://e.com/x'>first line<br>second line</a></p>", "【0†first line second line】"),
        ("<ul><li><a href='https://e.com/y'>foo<b>bar</b></a></li></ul>", "  * 【0†foobar】"),
        ("<li><a href='https://e.com/q'>A<h3>H</h3>B</a></li><p>after</p>", "  * 【0†A H B】\n\nafter"),
    ],
)
def test_blocks_inside_a_link_keep_its_words_apart(html, text):
    assert html_to_text(html, "https://e.com/").text == text


async def test_open_windows_scroll_and_cursors(session):
    result = await call(session, "browser.search", query="long page", topn=1)
    assert result.details == {
        "action": "search",
        "query": "long page",
        "cursor": 0,
        "sources": [{"url": LONG_PAGE_URL, "title": "A long page"}],
    }
    assert "【1†" not in result.text  # topn=1

    result = await call(session, "browser.open", id=0)
    header, scrollbar, blank, *body = result.text.split("\n")
    assert header == f"[1] A long page ({LONG_PAGE_URL})"
    first, last = (int(x) for x in scrollbar.strip("*").split("[")[1].split("]")[0].split(" - "))
    total = len(session.pages[1].lines) - 1
    assert scrollbar == f"**viewing lines [0 - {last}] of {total}**" and first == 0
    # The window holds view_tokens (200) of text, counting the line that crosses the limit.
    assert sum(words(f"{line}\n") for line in body[:-1]) < 200 <= sum(words(f"{line}\n") for line in body)
    assert body[0] == "L0: " and body[1] == f"L1: URL: {LONG_PAGE_URL}"

    result = await call(session, "browser.open", loc=last + 1, num_lines=3)
    assert f"**viewing lines [{last + 1} - {last + 3}] of {total}**" in result.text
    assert result.text.startswith("[2] A long page")  # scrolling pushes the page again
    assert session.backend.fetched == [LONG_PAGE_URL]

    result = await call(session, "browser.open", cursor=1, loc=total + 5)
    assert result.is_error
    assert result.text == f"Invalid location parameter: `{total + 5}`. Cannot exceed page maximum of {total}."
    assert len(session.pages) == 3  # the failed open was popped

    # Links on a page open other pages; pages fetched before come from the cache.
    result = await call(session, "browser.open", cursor=0, id=0)
    assert result.text.startswith("[3] A long page") and session.backend.fetched == [LONG_PAGE_URL]
    needle_link = next(k for k, v in session.pages[1].links.items() if v.endswith("/next"))
    result = await call(session, "browser.open", cursor=1, id=needle_link)
    assert result.text.startswith("[4] Next (https://docs.example.com/next)")
    # A URL given as a string is fetched again.
    await call(session, "browser.open", id=LONG_PAGE_URL)
    assert session.backend.fetched == [LONG_PAGE_URL, "https://docs.example.com/next", LONG_PAGE_URL]


async def test_find_results_and_opening_them(session):
    await call(session, "browser.open", id=LONG_PAGE_URL)
    result = await call(session, "browser.find", pattern="NEEDLE")
    page = session.pages[1]
    match_line = next(i for i, line in enumerate(session.pages[0].lines) if "needle" in line)
    assert result.text.startswith(
        f"[1] Find results for text: `NEEDLE` in `A long page` ({LONG_PAGE_URL}/find?pattern=NEEDLE)"
    )
    assert f"L0: # 【0†match at L{match_line}】\nL1: The needle is here." in result.text
    assert page.kind == "find" and page.result_lines == {0: match_line}
    result = await call(session, "browser.open", id=0)
    assert f"**viewing lines [{match_line - 4} - " in result.text  # a little context above
    # The source of a find page is that of the page searched (the find URL is made up).
    result = await call(session, "browser.open", cursor=1, view_source=True)
    assert not result.is_error and session.backend.fetched[-1] == LONG_PAGE_URL

    result = await call(session, "browser.find", pattern="zebra", cursor=0)
    assert "No `find` results for pattern: `zebra`" in result.text
    result = await call(session, "browser.find", pattern="x")  # on a find results page
    assert result.is_error and "Cannot run `find`" in result.text


@pytest.mark.parametrize(
    "recipient, arguments, message",
    [
        ("browser.open", "{}", "No pages to access!"),
        ("browser.find", '{"pattern": "a"}', "No pages to access!"),
        ("browser.search", '{"topn": 3}', "browser.search needs `query`"),
        ("browser.search", '{"query": "  "}', "browser.search needs a non-empty `query`"),
        ("browser.find", '{"pattern": ""}', "browser.find needs a non-empty `pattern`"),
        ("browser.search", '{"query": "q", "colour": "red"}', "Unknown argument(s) for browser.search: colour"),
        ("browser.search", "not json", "Invalid function arguments: not JSON"),
        ("browser.search", "[1, 2]", "expected a JSON object"),
        ("browser.open", '{"id": 1.5}', "`id` should be an integer"),
        ("browser.open", '{"cursor": "--1"}', "`cursor` should be an integer"),
        ("browser.search", '{"query": "q", "topn": "\u00b2"}', "`topn` should be an integer"),
        ("browser.fly", "{}", "Unknown function: browser.fly"),
        ("python", "{}", "Unknown function: python"),
    ],
)
async def test_bad_calls_become_tool_errors(session, recipient, arguments, message):
    result = await session.call(recipient, arguments)
    assert result.is_error and message in result.text


async def test_backend_failures_become_tool_errors(session):
    result = await call(session, "browser.search", query="explode")
    assert result.is_error and result.text == "Error during search for `explode`: backend exploded"
    result = await call(session, "browser.open", id="https://docs.example.com/missing")
    assert result.is_error
    assert result.text == "Error fetching URL `https://docs.example.com/missing`: 404 Not Found"
    await call(session, "browser.search", query="ok")
    result = await call(session, "browser.open", cursor=0, id=7)
    assert result.is_error and result.text == "Invalid link id `7`."
    result = await call(session, "browser.open", cursor=5)
    assert result.text == "Cursor `5` is out of range. Available cursor indices: [0 - 0]."


async def test_lenient_argument_forms(session):
    result = await session.call("browser.search", '{"query": "x", "top_n": "1"}')
    assert not result.is_error and len(result.details["sources"]) == 1
    await session.call("browser.search", '{"query": "x"}')
    result = await session.call("browser.open", '{"id": "1", "cursor": 1.0}')
    assert result.text.startswith("[2] Other page (https://other.example.org/x)")


def pages_for_citations() -> list[Page]:
    results = search_results_page(
        "q", [SearchHit("https://a.com/1", "Alpha", "first " * 30), SearchHit("https://b.com/2", "Beta", "second")]
    )
    article = page_from_html("<title>Article</title><p>Body text.</p>", "https://c.com/article")
    found = find_in_page(article, "body")
    return [results, article, found]


ARTICLE = "https://c.com/article"
ARTICLE_LINK = f"([c.com]({ARTICLE}))"
A_LINK, B_LINK = "([a.com](https://a.com/1))", "([b.com](https://b.com/2))"


@pytest.mark.parametrize(
    "answer, expected, cited",
    [
        ("Fact【1†L2-L3】.", f"Fact {ARTICLE_LINK}.", [(ARTICLE, "Article")]),
        ("Fact 【1†L2】 and more", f"Fact {ARTICLE_LINK} and more", [(ARTICLE, "Article")]),
        # Search results: the result on the cited line, or the one whose text wraps onto it.
        (
            "A【0†L4】 B【0†L6】 C【0†L7】",
            f"A {A_LINK} B {A_LINK} C {B_LINK}",
            [("https://a.com/1", "Alpha"), ("https://a.com/1", "Alpha"), ("https://b.com/2", "Beta")],
        ),
        # A find page cites the page searched.
        ("X【2†L0-L1】", f"X {ARTICLE_LINK}", [(ARTICLE, "Article")]),
        # Repeats of one source collapse; unknown cursors and headers with no result vanish.
        ("Y【1†L2】【1†L3】 Z【7†L1】. W【0†L1】!", f"Y {ARTICLE_LINK} Z. W!", [(ARTICLE, "Article")]),
        ("Partial at the end【1†L", "Partial at the end", []),
        # One marker alone, as a streaming caller passes it: it follows the cited words.
        ("【1†L2】", f" {ARTICLE_LINK}", [(ARTICLE, "Article")]),
        ("No citations here.", "No citations here.", []),
    ],
)
def test_citations(answer, expected, cited):
    text, annotations = resolve_citations(answer, pages_for_citations())
    assert text == expected
    assert [(a["url"], a["title"]) for a in annotations] == cited
    for a in annotations:
        assert a["type"] == "url_citation"
        assert text[a["start_index"] : a["end_index"]] == f"([{a['url'].split('/')[2]}]({a['url']}))"


async def test_special_token_text_and_real_tokenizer_windows():
    backend = MemoryBackend()
    lines = (f"Line {i} mentions <|start|> and <|call|> literally." for i in range(400))
    backend.pages["https://x.example.com/"] = "<p>" + "<br>".join(lines) + "</p>"
    session = BrowserSession(backend)  # the model's tokenizer counts the window
    result = await call(session, "browser.open", id="https://x.example.com/")
    assert not result.is_error, result.text
    encoding = harmony_encoding()
    shown = result.text.split("\n\n", 1)[1]
    tokens = len(encoding.encode(shown, allowed_special=set(), disallowed_special=()))
    assert 1000 <= tokens <= 1100  # 1024 tokens of lines, the last line rounded up


def test_harmony_namespace_and_system_message():
    server = BrowserToolServer(MemoryBackend())
    namespace = server.harmony_namespace()
    assert namespace.name == "browser"
    assert "sources=memory (default: memory)" in namespace.description
    assert [t.name for t in namespace.tools] == ["search", "open", "find"]
    from openai_harmony import Conversation, Message, Role, SystemContent

    system = SystemContent.new().with_tools(namespace)
    rendered = harmony_encoding().decode_utf8(
        harmony_encoding().render_conversation(
            Conversation.from_messages([Message.from_role_and_content(Role.SYSTEM, system)])
        )
    )
    assert "namespace browser {" in rendered and "【{cursor}†L{line_start}(-L{line_end})?】" in rendered


async def test_session_group_routes_by_namespace():
    class Echo:
        name, kind = "echo", "mcp"

        def open_session(self):
            outer = self

            class S:
                async def call(self, recipient, arguments):
                    return ToolResult(f"{recipient}:{arguments}")

                def resolve_citations(self, text):
                    return text, []

                async def close(self):
                    outer.closed = True

            return S()

    echo = Echo()
    group = ToolSessionGroup([BrowserToolServer(MemoryBackend()), echo])
    assert (await group.call("echo.say", "hi")).text == "echo.say:hi"
    result = await group.call("browser.search", '{"query": "q"}')
    assert not result.is_error
    result = await group.call("nothing.here", "{}")
    assert result.is_error and "Available namespaces: browser, echo" in result.text
    text, annotations = group.resolve_citations("See【0†L4】.")
    assert text == f"See ([docs.example.com]({LONG_PAGE_URL}))." and len(annotations) == 1
    await group.close()
    assert echo.closed
