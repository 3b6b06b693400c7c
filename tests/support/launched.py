"""Services as real processes beside a test's own Redis, started the way `burstrl up` starts them
(a Launcher under <home>/run, `service_env`'s production settings and a real token)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.cli.launch import Launcher
from tests.support.stack import service_env


@contextmanager
def service_launcher(home: Path, redis_url: str, token: str, **env: str) -> Iterator[tuple[Launcher, dict[str, str]]]:
    """A Launcher and the environment its services get (`env` on top); every service it started
    is stopped, by pid, on exit."""
    launcher = Launcher(home / "run")
    try:
        yield launcher, service_env(redis_url, home, token, **env)
    finally:
        launcher.stop_all()
