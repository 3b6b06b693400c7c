"""Bring the local stack up: embedded Redis (unless REDIS_URL is set) and the services."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.cli.launch import Launcher, alive, port_open
from shared.settings import DEFAULT_PORTS


def stack_env(
    home: Path, model: str, redis_url: str, store_url: str | None = None, *, reward_port: int | None = None
) -> dict[str, str]:
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
            "BURSTRL_TOOLS_SANDBOX_URL", f"http://127.0.0.1:{reward_port or DEFAULT_PORTS['reward']}"
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


def stack_ports(roles: list[str], *, base: int | None = None, given: dict[str, int] | None = None) -> dict[str, int]:
    """The port of each role: `given` (--ports), else `base` + the role's offset (--port-base),
    else the role's default (8700 + offset). Offsets: api 0, rollout 1, reward 2, ref 3, trainer 4."""
    given = given or {}
    if bad := [r for r in roles if r not in DEFAULT_PORTS]:
        raise ValueError(f"--roles: unknown roles {bad}; roles are {', '.join(DEFAULT_PORTS)}")
    unknown = set(given) - set(DEFAULT_PORTS)
    if unknown:
        raise ValueError(f"--ports: unknown roles {sorted(unknown)}; roles are {', '.join(DEFAULT_PORTS)}")
    first = min(DEFAULT_PORTS.values())
    out = {}
    for role in roles:
        if role in given:
            out[role] = given[role]
        elif base is not None:
            out[role] = base + DEFAULT_PORTS[role] - first
        else:
            out[role] = DEFAULT_PORTS[role]
        if not 1 <= out[role] <= 65535:
            raise ValueError(f"port {out[role]} for {role} is outside 1..65535")
    return out


def parse_ports(text: str) -> dict[str, int]:
    """'api=9000,rollout=9001' -> {"api": 9000, "rollout": 9001}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, sep, port = part.partition("=")
        if not sep or not port.strip().isdigit():
            raise ValueError(f"--ports: {part!r} is not ROLE=PORT (e.g. api=9000)")
        out[role.strip()] = int(port)
    return out


def start_stack(
    home: Path,
    model: str,
    roles: list[str],
    *,
    log: Callable[[str], None] = print,
    config: dict[str, Any] | None = None,
    model_given: bool = True,
    ports: dict[str, int] | None = None,
) -> Launcher:
    """Start `roles` (restarting only those, if an earlier `up` left them running) and, unless
    REDIS_URL is set or an earlier `up` started one, an embedded Redis.

    Services not named keep running: changing one service's setting restarts that service
    only, and the others keep their state and their ports."""
    launcher = Launcher(home / "run")
    for role in roles:
        launcher.stop(role)  # idempotent: only what is named is restarted
    running = {n: p for n, p in launcher.procs().items() if alive(p.pid)}
    ports = ports or stack_ports(roles)
    for role in roles:
        if port_open(ports[role]):
            raise RuntimeError(
                f"port {ports[role]} ({role}) is in use by a process we did not start: "
                "move the stack with --port-base N or --ports ROLE=PORT"
            )
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url and "redis" in running:
        redis_url = f"redis://127.0.0.1:{running['redis'].port}/0"
        log(f"redis: {redis_url} (already running)")
    elif not redis_url:
        redis_url = launcher.start_redis()
        log(f"redis: {redis_url}")
    reward_port = ports.get("reward") or (running["reward"].port if "reward" in running else None)
    env = stack_env(home, model, redis_url, reward_port=reward_port)
    for role in roles:
        p = launcher.start_service(role, {**env, **role_env(config, role, model_given)}, port=ports[role])
        log(f"started {role:<8} pid {p.pid}  http://127.0.0.1:{p.port}  log {p.log}")
    launcher.wait_ready(roles, timeout=600)
    log("all services ready")
    return launcher


def api_url(home: Path) -> str | None:
    """The api of the stack `burstrl up` runs under `home`, if it runs one (its port may be moved)."""
    p = Launcher(home / "run").procs().get("api")
    return f"http://127.0.0.1:{p.port}" if p is not None and alive(p.pid) else None
