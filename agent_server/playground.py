"""The web playground: a chat page at `/`, plain HTML/JS/CSS shipped in agent_server/static/.

The page and its assets need no API key (auth.py lists them as public; the page asks the user
for the key and sends it with its own API calls). The page is served with a strict
Content-Security-Policy: only its own scripts run, so even a rendering bug could not let model
output execute as script.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)


routes = [
    Route("/", page, methods=["GET", "HEAD"]),
    Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
]
