"""`GET /dashboard`: the live cache dashboard, a static page shipped inside the package.

The page needs no key to load; it reads `GET /v1/cache/stats` (which does) with the key the
user types once, and draws its charts itself, so it works with no network beyond this server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# The page loads only its own files and talks only to this server: a prompt that slipped past
# the page's escaping still could not run a script or send data elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

# URL path -> (file in static/, media type).
DASHBOARD_FILES = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def install_dashboard(app: FastAPI) -> None:
    """Adds the page and its script and style sheet (read once, here) to `app`."""
    static = resources.files("radixserve.server.observability") / "static"
    for path, (name, media_type) in DASHBOARD_FILES.items():
        body = (static / name).read_bytes()
        app.add_api_route(path, _static_route(body, media_type), methods=["GET"],
                          include_in_schema=False)


def _static_route(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve_file() -> Response:
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)
    return serve_file
