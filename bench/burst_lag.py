"""Learning against lag, bench/burst.py's table of it: jobs of a few steps with max_staleness L, the
trainer held (SIGSTOP) until rollout has filled min(L + 1, steps) batches from v0, then resumed;
rollout (its quota lifted) keeps the window full, so batches are up to L versions old (the measured
mean lag is in the table). Truncated IS against M2PO, final held-out accuracy (evaluated afterwards,
off every clock, by the lab's one evaluator)."""

from __future__ import annotations

import json
import signal
import statistics
import time
from typing import Any

import httpx

from bench.burst_setups import JOB, TASK
from shared.metrics import read_ledger, read_points
from tests.support.lab.heldout import evaluate_versions
from tests.support.lab.jobs import BATCH
from tests.support.lab.stack import MODEL, Stack, submit

MISMATCHES = ("token_truncate", "m2po")


def lag_runs(stack: Stack, lags: list[int], steps: int) -> list[dict[str, Any]]:
    """One job per lag and mismatch correction, a trainer started beside rollout for them. With
    L >= steps every batch is from v0 whatever L is: such a lag reuses the first run that had the
    same pre-fill (`same_as`) instead of running it again."""
    stack.start("trainer")
    stack.launcher.wait_ready(["trainer"], timeout=300)
    out: list[dict[str, Any]] = []
    done: dict[int, int] = {}  # pre-fill batches -> the lag that ran it
    for lag in lags:
        fill = min(lag + 1, steps)
        for mm in MISMATCHES:
            if fill in done:
                same = next(x for x in out if x["lag"] == done[fill] and x["mismatch"] == mm)
                out.append({**same, "lag": lag, "same_as": done[fill]})
                continue
            x = lag_run(stack, lag, mm, steps)
            print(json.dumps(x), flush=True)
            out.append(x)
        done.setdefault(fill, lag)
    return out


def evaluate_lags(lag: list[dict[str, Any]], store_url: str) -> None:
    """Each lag job's final version evaluated (with the stack stopped); a reused run shares its accuracy."""
    for x in lag:
        if "same_as" not in x:
            ev = evaluate_versions(str(MODEL), TASK, store_url, x["job_id"], {x["steps"]: 0.0})
            x["final_acc"] = ev[-1]["accuracy"]
    for x in lag:
        if "same_as" in x:
            x["final_acc"] = next(y for y in lag if y["job_id"] == x["job_id"] and "same_as" not in y)["final_acc"]


def lag_run(stack: Stack, lag: int, mismatch: str, steps: int, timeout: float = 900) -> dict[str, Any]:
    r = stack.r
    stack.signal("trainer", signal.SIGSTOP)
    body = {**JOB, "name": f"lag{lag}-{mismatch.replace('_', '-')}", "steps": steps, "max_staleness": lag}
    job_id = submit(stack, {**body, "algorithm": {"mismatch": mismatch}})
    fill = min(lag + 1, steps) * BATCH
    deadline = time.time() + timeout
    try:
        while read_ledger(r, job_id).get("scored", 0) < fill:
            if time.time() > deadline:
                raise RuntimeError(f"lag {lag}: rollout did not fill {fill} groups in {timeout:.0f}s")
            time.sleep(0.25)
    finally:
        stack.signal("trainer", signal.SIGCONT)
    while httpx.get(f"{stack.api}/v1/jobs/{job_id}", timeout=10).json()["job"]["state"] != "completed":
        if time.time() > deadline:
            raise RuntimeError(f"lag {lag} {mismatch}: not completed in {timeout:.0f}s\n{stack.logs()}")
        time.sleep(0.5)
    pts = read_points(r, job_id, "trainer")

    def mean(k: str) -> float | None:
        xs = [p[k] for p in pts if p.get(k) is not None]
        return round(statistics.fmean(xs), 4) if xs else None

    return {
        "lag": lag,
        "mismatch": mismatch,
        "job_id": job_id,
        "steps": steps,
        "lag_mean": mean("staleness_mean"),
        "lag_max": max(p["staleness_max"] for p in pts),
        "m2": mean("m2"),
        "mask_frac": mean("mask_frac"),
        "clip_frac": mean("clip_frac"),
        "ess": mean("ess"),
    }
