"""The dashboard harness: the api and reward services as real processes for a headless browser,
shared by the dashboard and backlog-view tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from services.cli.launch import Launcher, free_port
from tests.support.launched import service_launcher

if TYPE_CHECKING:
    from playwright.sync_api import Page

TOKEN = "dashboard-test-token-0123456789"
CHROMIUM = os.environ.get("BURSTRL_CHROMIUM", "/usr/bin/chromium")


def require_browser() -> None:
    # In CI a missing browser is a setup bug, not a reason to skip silently.
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install playwright)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"dashboard test needs {', '.join(missing)}")
        pytest.skip(f"needs {', '.join(missing)}")


@pytest.fixture
def stack(r, redis_server, tmp_path) -> Iterator[tuple[str, Launcher]]:
    """The api and reward services as real processes on free ports, stopped by pid."""
    with service_launcher(tmp_path, redis_server.url, TOKEN, BURSTRL_HEARTBEAT_S="0.5") as (launcher, env):
        api_port = free_port()
        launcher.start_service("api", env, port=api_port)
        launcher.start_service("reward", env, port=free_port())
        launcher.wait_ready(["api", "reward"], timeout=60)
        yield f"http://127.0.0.1:{api_port}", launcher


@contextmanager
def dashboard_page(base: str, *, width: int = 1400, log_in: bool = True) -> Iterator[Page]:
    """Headless Chromium on `base`'s dashboard (logged in with TOKEN unless `log_in` is False);
    on a clean exit, asserts the page raised no JavaScript errors meanwhile."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # Root in a container: Chromium's sandbox needs user namespaces we may not have.
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 1600})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/dashboard")
            if log_in:
                login(page)
            yield page
            assert not errors, errors
        finally:
            browser.close()


def login(page: Page) -> None:
    page.fill("#token", TOKEN)
    page.click("#login button[type=submit]")
