"""The console's HTML shell and static files, and the security headers every console answer carries.

The shell is one page (static/index.html); its scripts draw each view (``#/runs``, ``#/run/<id>``,
...) from the JSON routes. The Content-Security-Policy allows scripts, styles, images and fetches
from this origin only: nothing is loaded from elsewhere, no inline script runs, and no other site may
frame the console.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
PREFIX = "/console"
SECURITY_HEADERS = {
    "content-security-policy": ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'; form-action 'self'"),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def install(app: FastAPI) -> None:
    @app.middleware("http")
    async def _console_headers(request: Request, call_next):
        response = await call_next(request)
        if request.url.path == PREFIX or request.url.path.startswith(PREFIX + "/"):
            response.headers.update(SECURITY_HEADERS)
            if request.url.path.startswith(PREFIX + "/api/"):
                response.headers["cache-control"] = "no-store"
        return response

    @app.get(PREFIX, include_in_schema=False)
    async def _console_root():
        return RedirectResponse(PREFIX + "/", status_code=307)

    @app.get(PREFIX + "/", include_in_schema=False)
    async def _console_index():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount(PREFIX + "/static", StaticFiles(directory=STATIC), name="console-static")
