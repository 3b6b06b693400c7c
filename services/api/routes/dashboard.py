"""The dashboard: its data (`/v1/dashboard`, behind the token) and its page (public: the page
holds no data, and every JSON endpoint it calls stays authenticated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from services.api import jobs, overview
from services.api.deps import Redis

STATIC = Path(__file__).resolve().parents[1] / "static"
# Served without a token (services/api/app.py publishes them).
PAGE_PATHS = {"/", "/dashboard"}
STATIC_MOUNT = "/dashboard/static"
# The page is ours and self-contained: scripts and styles only from the api itself.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(prefix="/v1/dashboard", tags=["dashboard"])


@router.get("")
def dashboard_data(r: Redis) -> dict[str, Any]:
    """Services, and per job (the active ones and the newest few, newest first): queues, ledger,
    policy pointer and its adoption by replicas; `unreadable`: job id -> why its stored record
    cannot be read (those jobs are not served)."""
    recs, unreadable = jobs.dashboard_jobs(r)
    return {**overview.overview(r, recs), "unreadable": unreadable}


page = APIRouter(include_in_schema=False)


@page.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/dashboard")


@page.get("/dashboard")
def dashboard_page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


def mount_page(app: FastAPI) -> None:
    """The page, its redirect and its static files (no token)."""
    app.include_router(page)
    app.mount(STATIC_MOUNT, StaticFiles(directory=STATIC), name="dashboard-static")
