"""Bring the local stack up: embedded Redis (unless REDIS_URL is set) and the services."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.cli.launch import Launcher, port_open
from shared.settings import DEFAULT_PORTS


def stack_env(home: Path, model: str, redis_url: str, store_url: str | None = None) -> dict[str, str]:
    home = home.resolve()
    cores = len(os.sched_getaffinity(0))
    env = {
        "REDIS_URL": redis_url,
        "STORE_URL": store_url or os.environ.get("STORE_URL") or f"file://{home / 'store'}",
        "BURSTRL_DATA_DIR": str(home / "data"),
        "BURSTRL_ROLLOUT_MODEL": model,
        # The ref replica serves the base model unless told to serve a teacher (distillation).
        "BURSTRL_REF_MODEL": os.environ.get("BURSTRL_REF_MODEL", model),
        # Every service shares this machine's cores, and idle OpenMP threads spin: a process
        # with as many threads as cores steals them from the others. On 2 cores the demo
        # pipeline ran 24.9 groups/s with OpenMP pools of 2 threads (rollout, reward, api; trainer
        # and ref at 1 by their settings) and 38.4 with 1
        # (`bench/pipeline.py --ab OMP_NUM_THREADS=2 --layouts shared --steps 10 --rounds 2`).
        # So each process's OpenMP pools get a share of the cores; trainer and ref set theirs,
        # vLLM binds its own kernels.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, cores // 2))),
        "BURSTRL_TRAINER_THREADS": str(max(1, cores // 2)),
        "BURSTRL_REF_THREADS": str(max(1, cores // 4)),
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's "auto" dtype runs an fp32 checkpoint in bf16 on CPU; in fp32 the sampler's
        # log-probs match the fp32 trainer's and the version probe can use a tight tolerance.
        "BURSTRL_ROLLOUT_DTYPE": os.environ.get("BURSTRL_ROLLOUT_DTYPE", "float32"),
        # Rollout's "python" environment runs tool code on the reward service's sandbox; its token
        # is the stack's BURSTRL_TOKEN (ToolSettings falls back to it), none in local-dev mode.
        "BURSTRL_TOOLS_SANDBOX_URL": os.environ.get(
            "BURSTRL_TOOLS_SANDBOX_URL", f"http://127.0.0.1:{DEFAULT_PORTS['reward']}"
        ),
    }
    if not os.environ.get("BURSTRL_TOKEN"):
        env["BURSTRL_DEV"] = "1"  # loopback-only local-dev mode
    return env


def role_env(config: dict[str, Any] | None, role: str, model_given: bool) -> dict[str, str]:
    """A config file's `[env.common]` and `[env.<role>]` tables, minus what the real
    environment sets: the process environment always overrides the file.

    The files in configs/ carry these tables (env of each service, as the planner sized
    it); `burstrl up --config FILE` applies them. An explicit --model wins over the file.
    """
    tables = (config or {}).get("env", {})
    merged: dict[str, Any] = {**tables.get("common", {}), **tables.get(role, {})}
    if model_given:
        merged = {k: v for k, v in merged.items() if k not in ("BURSTRL_ROLLOUT_MODEL", "BURSTRL_REF_MODEL")}
    out = {}
    for k, v in merged.items():
        if k in os.environ:
            continue
        if isinstance(v, dict | list):
            raise ValueError(f"[env.{role}] {k}: expected a string, number or boolean")
        out[k] = ("1" if v else "0") if isinstance(v, bool) else str(v)
    return out


def start_stack(
    home: Path,
    model: str,
    roles: list[str],
    *,
    log: Callable[[str], None] = print,
    config: dict[str, Any] | None = None,
    model_given: bool = True,
) -> Launcher:
    launcher = Launcher(home / "run")
    launcher.stop_all()  # idempotent: leftovers of an earlier run are stopped first
    for role in roles:
        if port_open(DEFAULT_PORTS[role]):
            raise RuntimeError(f"port {DEFAULT_PORTS[role]} ({role}) is in use by a process we did not start")
    redis_url = os.environ.get("REDIS_URL") or launcher.start_redis()
    log(f"redis: {redis_url}")
    env = stack_env(home, model, redis_url)
    for role in roles:
        p = launcher.start_service(role, {**env, **role_env(config, role, model_given)})
        log(f"started {role:<8} pid {p.pid}  http://127.0.0.1:{p.port}  log {p.log}")
    launcher.wait_ready(roles, timeout=600)
    log("all services ready")
    return launcher
