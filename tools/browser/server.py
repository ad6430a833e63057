"""The built-in `browser` tool server: one search backend shared by per-response sessions."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from openai_harmony import ToolNamespaceConfig

from tools.browser.backend import SearchBackend
from tools.browser.session import BrowserSession

logger = logging.getLogger(__name__)

DEMO_CORPUS = Path(__file__).with_name("demo_corpus")
TRAINED_SOURCES = "sources=web (default: web)"


class BrowserToolServer:
    name = "browser"
    kind = "browser"

    def __init__(self, backend: SearchBackend, *, view_tokens: int = 1024, max_search_results: int = 20):
        self.backend = backend
        self.view_tokens = view_tokens
        self.max_search_results = max_search_results

    @classmethod
    async def start(
        cls,
        *,
        search_dir: str | os.PathLike | None = None,
        exa_api_key: str | None = None,
        exa_base_url: str | None = None,
        **options,
    ) -> BrowserToolServer:
        """Local search over `search_dir` if given, else Exa if a key is given, else the bundled
        demo documents."""
        from tools.browser.local_backend import LocalSearchBackend

        backend: SearchBackend
        if search_dir is not None:
            backend = await LocalSearchBackend.open(search_dir)
            logger.info("browser: searching the %d documents under %s", backend.document_count, backend.folder)
        elif exa_api_key:
            from tools.browser.exa_backend import EXA_API_URL, ExaBackend

            backend = ExaBackend(exa_api_key, base_url=exa_base_url or EXA_API_URL)
            logger.info("browser: searching the web through Exa")
        else:
            backend = await LocalSearchBackend.open(DEMO_CORPUS, trusted_links=True)
            logger.warning(
                "browser: no --search-dir and no EXA_API_KEY; searching only the %d bundled demo "
                "documents in %s (this project's README and BENCHMARKS, and three pages about "
                "gpt-oss and Harmony)",
                backend.document_count,
                DEMO_CORPUS,
            )
        return cls(backend, **options)

    @property
    def live_web(self) -> bool:
        """Whether searches reach the live web (Exa), not local documents only."""
        return self.backend.source_name == "web"

    def harmony_namespace(self) -> ToolNamespaceConfig:
        config = ToolNamespaceConfig.browser()
        source = self.backend.source_name
        config.description = config.description.replace(TRAINED_SOURCES, f"sources={source} (default: {source})")
        return config

    def open_session(self) -> BrowserSession:
        return BrowserSession(self.backend, view_tokens=self.view_tokens, max_search_results=self.max_search_results)

    async def aclose(self) -> None:
        await self.backend.aclose()
