"""The `browser` tool: search, open and find, over Exa or a local folder of documents."""

from .backend import BackendError, RetryPolicy, SearchBackend
from .citations import resolve_citations
from .documents import SearchHit
from .page import Page
from .server import BrowserToolServer
from .session import BrowserSession

__all__ = ["BackendError", "BrowserSession", "BrowserToolServer", "Page", "RetryPolicy",
           "SearchBackend", "SearchHit", "resolve_citations"]
