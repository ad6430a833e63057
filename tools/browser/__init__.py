"""The `browser` tool: search, open and find, over Exa or a local folder of documents."""

from tools.browser.backend import BackendError, RetryPolicy, SearchBackend
from tools.browser.citations import resolve_citations
from tools.browser.documents import SearchHit
from tools.browser.page import Page
from tools.browser.server import BrowserToolServer
from tools.browser.session import BrowserSession

__all__ = ["BackendError", "BrowserSession", "BrowserToolServer", "Page", "RetryPolicy",
           "SearchBackend", "SearchHit", "resolve_citations"]
