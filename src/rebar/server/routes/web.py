"""The chat page at `/` and its files under `/static/`.

Both stay open when API keys are on (`ApiKeyMiddleware` lets them through): the page has to
load before the user can type a key into it.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from rebar.web import STATIC_DIR


def install(app: FastAPI) -> None:
    index = STATIC_DIR / "index.html"

    # The page names its script and stylesheet with a content hash, so only the page itself
    # must be revalidated for a browser to pick up a new build.
    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(index, headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
