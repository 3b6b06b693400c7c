"""Load: 20 concurrent jobs through one stack against the same work as one job alone (issue 47, item 6).

One stack (redis-server, api, reward, ref, rollout, trainer on the tiny model), per configuration:
- "one job": one job of `jobs x steps` steps alone;
- "N jobs": `jobs` jobs of `steps` steps each, submitted at once: the same groups in all.
Measured, each side: trained groups/s over the makespan (first submission to last job completed:
the trainer's claims and model builds per job included), the api's latency while a client polls
it (a job's status, a page of GET /v1/jobs, the dashboard's data) from its own thread, and Redis's
used_memory before, at its peak during the run, and after (per job). At the end every job's ledger
is audited (shared/ledger.py). `--replicas 2` runs the same with 2 rollout and 2 reward replicas.

    .venv/bin/python bench/load.py [--jobs 20] [--steps 6] [--rounds 2] [--replicas 1,2] [--out bench/results/load.md]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from shared.job import JobState, load_job  # noqa: E402
from shared.ledger import audit  # noqa: E402
from tests.support.lab.jobs import DEMO_SHAPE  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command, table  # noqa: E402
from tests.support.lab.stack import MODEL, Stack, submit  # noqa: E402

POLL_S = 0.05  # the api client's pause between requests


class ApiPoller:
    """A client polling the api while the jobs run; keeps each request's latency by endpoint."""

    def __init__(self, api: str, job_ids: list[str]) -> None:
        self.api, self.job_ids = api, job_ids
        self.lat: dict[str, list[float]] = {"status": [], "list": [], "dashboard": []}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ApiPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(base_url=self.api, timeout=30) as c:
            while not self._stop.is_set():
                for name, path in (
                    ("status", f"/v1/jobs/{random.choice(self.job_ids)}"),
                    ("list", "/v1/jobs?limit=20"),
                    ("dashboard", "/v1/dashboard"),
                ):
                    t0 = time.perf_counter()
                    try:
                        ok = c.get(path).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    self.lat[name].append(time.perf_counter() - t0)
                    self.errors += not ok
                    self._stop.wait(POLL_S)


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else 0.0)


def used_memory(st: Stack) -> int:
    return int(st.r.info("memory")["used_memory"])


def run_side(st: Stack, n_jobs: int, steps: int, timeout: float) -> dict[str, Any]:
    """Submit `n_jobs` jobs of `steps` steps at once; follow them to completion."""
    spec = {**DEMO_SHAPE, "steps": steps, "eval_size": 0}
    mem0 = used_memory(st)
    t0 = time.time()
    ids = [submit(st, {**spec, "name": f"load{n_jobs}-{i}"}) for i in range(n_jobs)]
    peak = mem0
    with ApiPoller(st.api, ids) as poller:
        while True:
            peak = max(peak, used_memory(st))
            states = [rec.state if (rec := load_job(st.r, j)) else None for j in ids]  # not through the api
            done = sum(s == JobState.completed for s in states)
            failed = [j for j, s in zip(ids, states, strict=True) if s in (JobState.failed, JobState.cancelled)]
            if failed:
                raise RuntimeError(f"jobs failed: {failed}\n{st.logs()}")
            if done == n_jobs:
                break
            if time.time() - t0 > timeout:
                raise RuntimeError(f"{done}/{n_jobs} jobs done after {timeout:.0f} s\n{st.logs()}")
            time.sleep(0.5)
    makespan = time.time() - t0
    audits = [audit(st.r, j) for j in ids]
    trained = sum(a.counters.get("trained", 0) for a in audits)
    return {
        "jobs": n_jobs,
        "steps": steps,
        "makespan_s": round(makespan, 2),
        "trained_groups": trained,
        "groups_per_s": round(trained / makespan, 3),
        "balanced": sum(a.balanced for a in audits),
        "problems": [p for a in audits for p in a.problems][:10],
        "api": {
            k: {"n": len(v), "p50_ms": round(pct(v, 50) * 1000, 1), "p99_ms": round(pct(v, 99) * 1000, 1)}
            for k, v in poller.lat.items()
        },
        "api_errors": poller.errors,
        "redis_bytes": {"before": mem0, "peak": peak, "after": used_memory(st)},
        "load_avg": os.getloadavg(),
    }


def median_rate(runs: list[dict[str, Any]]) -> float:
    return statistics.median(x["groups_per_s"] for x in runs)


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: N concurrent jobs against one alone, per replica count."""
    out: list[Figure] = []
    for rep, sides in res["results"].items():
        one, many = median_rate(sides["one"]), median_rate(sides["many"])
        out.append(
            figure(
                f"{sides['many'][0]['jobs']} concurrent jobs / one job alone, trained groups/s "
                f"({rep} rollout+reward replica(s))",
                f"{many:.2f} groups/s",
                baseline=f"{one:.2f} groups/s one job alone",
                ratio=many / one,
                target=">= 0.8",
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=6, help="Steps of each concurrent job (the lone job: jobs x steps).")
    ap.add_argument("--replicas", default="1,2", help="Rollout and reward replicas, one stack each.")
    ap.add_argument("--rounds", type=int, default=2, help="Rounds of both sides, in ABBA order.")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", type=Path, default=None, help="Markdown here; .json beside it.")
    a = ap.parse_args()
    cmd = shown_command(__file__)
    results: dict[str, dict[str, Any]] = {}
    for rep in (int(x) for x in a.replicas.split(",")):
        with (
            tempfile.TemporaryDirectory(prefix="burstrl-load-") as tmp,
            Stack(Path(tmp), a.model, rollouts=rep, rewards=rep) as st,
        ):
            run_side(st, 1, 2, a.timeout)  # warm-up, not counted: the first claim's caches, the engines' first batches
            sides: dict[str, list[dict[str, Any]]] = {"one": [], "many": []}
            for k in range(a.rounds):  # ABBA: a load that drifts during the run weighs on both sides
                for side in ("one", "many") if k % 2 == 0 else ("many", "one"):
                    n, steps = (1, a.jobs * a.steps) if side == "one" else (a.jobs, a.steps)
                    sides[side].append({**run_side(st, n, steps, a.timeout), "round": k})
                    print(f"replicas {rep} {side}: {sides[side][-1]}", flush=True)
            results[str(rep)] = sides
    rows = []
    for rep, sides in results.items():
        for x in sorted([*sides["one"], *sides["many"]], key=lambda x: (x["round"], x["jobs"])):
            mem = x["redis_bytes"]
            rows.append(
                [
                    rep,
                    x["round"],
                    f"{x['jobs']} x {x['steps']} steps",
                    f"{x['makespan_s']:.0f}",
                    f"{x['groups_per_s']:.2f}",
                    f"{x['balanced']}/{x['jobs']}",
                    " / ".join(f"{x['api'][k]['p50_ms']:.0f}, {x['api'][k]['p99_ms']:.0f}" for k in x["api"]),
                    f"{(mem['peak'] - mem['before']) / x['jobs'] / 1024:.0f}",
                    f"{(mem['after'] - mem['before']) / x['jobs'] / 1024:.0f}",
                    ", ".join(f"{v:.1f}" for v in x["load_avg"]),
                ]
            )
    lines = [
        "## Load: concurrent jobs through one stack",
        "",
        f"`{cmd}` — the demo's job shape (G={DEMO_SHAPE['group_size']}, batch {DEMO_SHAPE['batch_size']}), eval off, "
        f"on the tiny model; {a.jobs} jobs of {a.steps} steps at once against one job of {a.jobs * a.steps} steps "
        f"alone (the same groups), on the same stack, {a.rounds} rounds in ABBA order after a warm-up job of 2 "
        "steps. Trained groups/s over the makespan (submission to the last completion). One Redis (not a cluster).",
        "",
        *table(
            [
                "rollout+reward replicas",
                "round",
                "jobs",
                "makespan s",
                "trained groups/s",
                "ledgers balanced",
                "api p50, p99 ms: status / list / dashboard",
                "Redis KiB per job at peak",
                "Redis KiB per job after",
                "load avg (1, 5, 15 min) at the end",
            ],
            rows,
        ),
        "",
    ]
    for rep, sides in results.items():
        one, many = median_rate(sides["one"]), median_rate(sides["many"])
        lines.append(
            f"**{rep} replica(s): {a.jobs} jobs / one job = {many / one:.2f}x** trained groups/s, medians of "
            f"{a.rounds} rounds ({many:.2f} against {one:.2f}; target >= 0.8)."
        )
    lines += [
        "",
        f"The machine: {os.cpu_count()} cores, shared with other work while this ran (see the load averages). "
        "One trainer trains one job at a time (services/trainer/claim.py), so concurrent jobs take turns on it, "
        "each turn paying the job's claim and model build.",
        "",
    ]
    emit("\n".join(lines), a.out, {"results": results}, figures=figures({"results": results}), command=cmd)


if __name__ == "__main__":
    main()
