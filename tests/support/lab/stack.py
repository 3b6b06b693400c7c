"""A service stack for the lab: redis-server and the services as local processes on free ports
(what `burstrl up` runs), a job submitted over HTTP and followed to completion.

Unlike tests/support/stack.py's `service_stack` (a test's fixed set of roles in production mode),
this one pins roles to cores, runs rollout replicas, pauses and restarts services mid-run, and
runs in dev mode: what the benchmarks and the chaos run need."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from services.cli.launch import Launcher, free_port, tail
from services.cli.stack import stack_env
from shared import keys
from shared.metrics import read_evals, read_ledger, read_points
from shared.redis_conn import connect
from tests.support import ROOT

MODEL = ROOT / ".burstrl" / "models" / "tiny-sft"
ROLES = ["api", "reward", "ref", "rollout", "trainer"]


class Stack:
    """redis-server + the services on free ports under `home`; everything stopped by pid on exit.

    `rollouts` > 1 starts extra rollout replicas (own port, own scratch dir) in the same
    consumer group; `rewards` > 1 the same for reward. `env` is added to every service's environment. `cpus` pins roles to
    cores (see `split_layout`).
    """

    def __init__(
        self,
        home: Path,
        model: str | Path = MODEL,
        *,
        roles: list[str] | None = None,
        rollouts: int = 1,
        rewards: int = 1,
        env: dict[str, str] | None = None,
        store_url: str | None = None,
        cpus: dict[str, set[int]] | None = None,
    ) -> None:
        self.home = home.resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.model = str(model)
        self.roles = list(roles or ROLES)
        self.n_rollouts = rollouts
        self.n_rewards = rewards
        self.extra_env = env or {}
        self.store_url = store_url
        self.cpus = cpus or {}  # role -> cores it is pinned to (a layout; empty: all share every core)
        self.launcher = Launcher(self.home / "run")
        self.ports: dict[str, int] = {}
        self.env: dict[str, str] = {}
        self.redis_url = ""

    @property
    def names(self) -> list[str]:
        out = [r for r in self.roles if r not in ("rollout", "reward")]
        for role, n in (("reward", self.n_rewards), ("rollout", self.n_rollouts)):
            if role in self.roles:
                out += [role] + [f"{role}{i}" for i in range(2, n + 1)]
        return out

    def __enter__(self) -> Stack:
        if Path(self.model) == MODEL:  # a fresh clone has none yet: build it, as `make demo` would
            from shared.ml.models import ensure_tiny_model

            ensure_tiny_model(MODEL)
        t0 = time.time()
        self.redis_port = free_port()
        self.redis_url = self.launcher.start_redis(self.redis_port)
        self.env = {**stack_env(self.home, self.model, self.redis_url, self.store_url), **self.extra_env}
        self.env["BURSTRL_DEV"] = "1"
        try:
            for name in self.names:
                self.start(name)
            self.launcher.wait_ready(self.names, timeout=600)
        except BaseException:
            self.launcher.stop_all()
            raise
        self.startup_s = time.time() - t0
        self.r = connect(self.redis_url)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.launcher.procs():  # a paused process ignores SIGTERM until continued
            self.signal(name, signal.SIGCONT)
        self.launcher.stop_all()

    def role(self, name: str) -> str:
        return next((r for r in ("rollout", "reward") if name.startswith(r)), name)

    def start(self, name: str, env: dict[str, str] | None = None) -> None:
        """(Re)start one service on its port (the same port after a crash); `env` adds to the stack's."""
        self.ports.setdefault(name, free_port())
        env = {**self.env, **(env or {})}
        if self.role(name) != name:  # replicas: their own scratch
            env["BURSTRL_DATA_DIR"] = str(self.home / f"data-{name}")
        cpus = self.cpus.get(self.role(name))
        if cpus:
            # The service's compute threads match its cores: vLLM binds its OpenMP threads
            # itself (its "auto" would pick cores outside the set), torch follows OMP_NUM_THREADS.
            env["OMP_NUM_THREADS"] = str(len(cpus))
            env["BURSTRL_TRAINER_THREADS"] = str(len(cpus))
            if self.role(name) == "rollout":
                lo, hi = min(cpus), max(cpus)  # layouts hand out contiguous ranges
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(lo) if lo == hi else f"{lo}-{hi}"
        elif name.startswith("rollout") and self.n_rollouts > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in self.extra_env:
            # vLLM-cpu's "auto" binding pins every engine on the box to the same first core;
            # replicas sharing a machine each get their own core instead.
            idx = 0 if name == "rollout" else int(name[len("rollout") :]) - 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(idx % (os.cpu_count() or 1))
        self.launcher.start_service(self.role(name), env, name=name, port=self.ports[name], cpus=cpus)

    def start_redis_again(self) -> None:
        self.launcher.start_redis(self.redis_port)

    def pid(self, name: str) -> int:
        return self.launcher.procs()[name].pid

    def signal(self, name: str, sig: int) -> None:
        """To the service's whole process group (vLLM's engine core process included)."""
        try:
            os.killpg(self.pid(name), sig)
        except (ProcessLookupError, KeyError):
            pass

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports['api']}"

    def logs(self, n: int = 15) -> str:
        return "\n".join(f"--- {k}\n{tail(p.log, n)}" for k, p in self.launcher.procs().items())


def split_layout(n_cpus: int | None = None) -> dict[str, set[int]]:
    """One box laid out like the deployment burstrl is built for: the always-on inference
    side (rollout, ref, reward, api) on the first half of the cores, the trainer (the rented
    GPU in production) on the other half. Each side then has its own hardware, as it does
    in production, instead of every stage contending for every core."""
    n = n_cpus or len(os.sched_getaffinity(0))
    if n < 2:
        raise SystemExit("the split layout needs at least 2 cores")
    infer, train = set(range(n // 2)), set(range(n // 2, n))
    return {"api": infer, "reward": infer, "ref": infer, "rollout": infer, "trainer": train}


def submit(stack: Stack, spec: dict[str, Any]) -> str:
    body = {**spec, "base_model": stack.model}
    resp = httpx.post(f"{stack.api}/v1/jobs", json=body, timeout=30)
    resp.raise_for_status()
    return resp.json()["id"]


def steady_rate(points: list[dict[str, Any]], skip: int = 1) -> float:
    """Groups trained per second from the trainer's points, after `skip` warm-up steps."""
    pts = sorted(points, key=lambda p: p["step"])
    if len(pts) <= skip + 1:
        return 0.0
    groups = sum(p["groups"] for p in pts[skip + 1 :])
    return groups / (pts[-1]["at"] - pts[skip]["at"])


def run_job(stack: Stack, spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Submit a job, wait until it is completed and (when evaluated) its last version evaluated."""
    spec = {"name": "bench", **spec}
    t0 = time.time()
    job_id = submit(stack, spec)
    r = stack.r
    deadline = t0 + timeout
    while True:
        status = httpx.get(f"{stack.api}/v1/jobs/{job_id}", timeout=10).json()
        done = status["job"]["state"] == "completed"
        evals = read_evals(r, job_id)
        if done and (spec.get("eval_size", 64) == 0 or any(e["version"] == spec["steps"] for e in evals)):
            break
        if status["job"]["state"] in ("failed", "cancelled"):
            raise RuntimeError(f"job {job_id} {status['job']['state']}: {status['job'].get('error')}")
        if time.time() > deadline:
            raise RuntimeError(f"job {job_id} not done after {timeout:.0f}s\n{stack.logs()}")
        time.sleep(0.5)
    points = sorted(read_points(r, job_id, "trainer"), key=lambda p: p["step"])
    return {
        "job_id": job_id,
        "spec": spec,
        "submitted_at": t0,
        "trained_at": points[-1]["at"],
        "done_at": time.time(),
        "points": points,
        "evals": evals,
        "ledger": read_ledger(r, job_id),
        "groups_per_s": round(steady_rate(points), 3),
    }


def wait_counter(r: Any, job_id: str, field: str, target: int, timeout: float) -> tuple[float, int, float]:
    """Poll the ledger counter until it reaches target: (time of first move, value then, time of last)."""
    deadline = time.time() + timeout
    start = int(r.hget(keys.ledger(job_id), field) or 0)
    first_t, first_v = 0.0, start
    while True:
        v = int(r.hget(keys.ledger(job_id), field) or 0)
        now = time.perf_counter()
        if v > start and not first_t:
            first_t, first_v = now, v
        if v >= target:
            return first_t, first_v, now
        if time.time() > deadline:
            raise RuntimeError(f"{field} stuck at {v}/{target} after {timeout:.0f}s")
        time.sleep(0.02)
