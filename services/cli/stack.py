"""Bring the local stack up: embedded Redis (unless REDIS_URL is set) and the services."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from services.cli.launch import Launcher, port_open
from shared.settings import DEFAULT_PORTS


def stack_env(home: Path, model: str, redis_url: str, store_url: str | None = None) -> dict[str, str]:
    home = home.resolve()
    env = {
        "REDIS_URL": redis_url,
        "STORE_URL": store_url or os.environ.get("STORE_URL") or f"file://{home / 'store'}",
        "BURSTRL_DATA_DIR": str(home / "data"),
        "BURSTRL_ROLLOUT_MODEL": model,
        "BURSTRL_REF_MODEL": model,
        "BURSTRL_TRAINER_THREADS": "1",  # 2-core laptops: leave a core to vLLM
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not os.environ.get("BURSTRL_TOKEN"):
        env["BURSTRL_DEV"] = "1"  # loopback-only local-dev mode
    return env


def start_stack(home: Path, model: str, roles: list[str], *, log: Callable[[str], None] = print) -> Launcher:
    launcher = Launcher(home / "run")
    launcher.stop_all()  # idempotent: leftovers of an earlier run are stopped first
    for role in roles:
        if port_open(DEFAULT_PORTS[role]):
            raise RuntimeError(f"port {DEFAULT_PORTS[role]} ({role}) is in use by a process we did not start")
    redis_url = os.environ.get("REDIS_URL") or launcher.start_redis()
    log(f"redis: {redis_url}")
    env = stack_env(home, model, redis_url)
    for role in roles:
        p = launcher.start_service(role, env)
        log(f"started {role:<8} pid {p.pid}  http://127.0.0.1:{p.port}  log {p.log}")
    launcher.wait_ready(roles, timeout=600)
    log("all services ready")
    return launcher
