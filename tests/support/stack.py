"""`service_stack`: a RedisServer plus the services as processes on free ports, for the
end-to-end tests, and `wait_for`, which fails with the services' log tails."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.cli.launch import Launcher, free_port
from services.cli.stack import stack_env
from tests.support.servers import RedisServer
from tests.support.waits import Deadline


def wait_for(pred, timeout: float, what: str, launcher=None, poll_s: float = 0.5):  # noqa: ANN001
    """Poll `pred` until it returns something truthy; after `timeout` idle-machine seconds
    (tests/support/waits.py) fail with the services' log tails."""
    from services.cli.launch import tail

    deadline = Deadline(timeout)
    while deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    logs = "\n".join(f"--- {n}\n{tail(p.log, 15)}" for n, p in launcher.procs().items()) if launcher else ""
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def service_env(redis_url: str, home: Path, token: str, **extra: str) -> dict[str, str]:
    """The environment a service started by a test gets: Redis, a file:// store under `home`, a
    real token, production mode (BURSTRL_DEV=0); `extra` on top."""
    return {
        "REDIS_URL": redis_url,
        "STORE_URL": f"file://{home / 'store'}",
        "BURSTRL_TOKEN": token,
        "BURSTRL_DEV": "0",
        **extra,
    }


def readyz(port: int) -> tuple[int, dict]:
    """A service's /readyz: (status, body), or (0, {}) while it does not answer."""
    try:
        resp = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=3)
        return resp.status_code, resp.json()
    except httpx.HTTPError:
        return 0, {}


@dataclass
class ServiceStack:
    """What `service_stack` started: the launcher of the services, their env and ports, and
    the RedisServer (tests may kill and restart services or Redis through these)."""

    launcher: Launcher
    redis: RedisServer | None  # None: the stack runs on a Redis the caller gave (`redis_url`)
    env: dict[str, str]
    ports: dict[str, int]
    started_at: float  # time.time() just before the first service was started

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    @property
    def api(self) -> str:
        return self.url("api")


@contextmanager
def service_stack(
    tmp_path: Path,
    model: Path | str,
    roles: Sequence[str],
    *,
    env_extra: Mapping[str, str] | None = None,
    role_env: Mapping[str, Mapping[str, str]] | None = None,
    store_url: str | None = None,
    ready_timeout: float = 400,
    redis_url: str | None = None,
) -> Iterator[ServiceStack]:
    """A RedisServer (data in tmp_path/redis-data) and `roles` as processes on free ports, with
    `stack_env(tmp_path, model, redis, store_url)` plus `env_extra` (and `role_env[role]` for that
    role only), ready within `ready_timeout` s. On exit the services are stopped, then Redis.
    `redis_url`: run on that Redis (a cluster's, say) instead, left running."""
    srv = None
    if redis_url is None:
        (tmp_path / "redis-data").mkdir()
        srv = RedisServer(tmp_path / "redis-data")
        srv.start()
    try:
        launcher = Launcher(tmp_path / "run")
        url = srv.url if srv is not None else redis_url
        assert url is not None
        env = {**stack_env(tmp_path, str(model), url, store_url=store_url), **(env_extra or {})}
        ports = {role: free_port() for role in roles}
        stack = ServiceStack(launcher, srv, env, ports, time.time())
        try:
            for role in roles:
                launcher.start_service(role, {**env, **(role_env or {}).get(role, {})}, port=ports[role])
            launcher.wait_ready(list(roles), timeout=ready_timeout)
            yield stack
        finally:
            launcher.stop_all()
    finally:
        if srv is not None:
            srv.kill()
