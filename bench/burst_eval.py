"""Which of a bench/burst.py run's versions are evaluated, and evaluating them: after the stack is
stopped, off every clock, by the lab's one held-out evaluator (tests/support/lab/heldout.py).

Every other version up to EVAL_DENSE, then a few evenly spaced, and those the on-policy comparison
needs (`eval_versions`); then, where the grid skipped versions between the last below the threshold
and the first at it, up to 8 of those (`refine`), so billable seconds to the threshold are read
where the crossing is."""

from __future__ import annotations

import math
import time
from typing import Any

from bench.burst_setups import TASK
from tests.support.lab.heldout import evaluate_versions
from tests.support.lab.stack import MODEL

# Every EVAL_EVERY-th version up to EVAL_DENSE, then EVAL_SPARSE evenly spaced (one evaluation
# takes ~10 s on this shared box at load ~12).
EVAL_EVERY, EVAL_DENSE, EVAL_SPARSE = 2, 24, 4


def eval_versions(versions: list[int], also: tuple[int, ...] = ()) -> list[int]:
    dense = [v for v in versions if v <= EVAL_DENSE and v % EVAL_EVERY == 0]
    rest = [v for v in versions if v > EVAL_DENSE]
    if rest:
        stride = max(1, math.ceil(len(rest) / EVAL_SPARSE))
        dense += rest[::stride] + [rest[-1]]
    return sorted(set(dense) | {v for v in also if v in versions})


def refine(versions: list[int], evals: list[dict[str, Any]], threshold: float, most: int = 8) -> list[int]:
    """Versions to evaluate between the last evaluated one below the threshold and the first at or above
    it, where the grid skipped some (up to `most`, evenly spaced). Billable s to the threshold is read
    at the first evaluation that reaches it, and past EVAL_DENSE the grid is sparse: a backlog run that
    made v25 at 14.1 s (0.484) was next evaluated at v46, 30.9 s, and read 30.9 s (2026-12-04)."""
    ev = sorted(evals, key=lambda e: e["version"])
    hit = next((e["version"] for e in ev if e["accuracy"] >= threshold), None)
    if hit is None:
        return []
    before = max((e["version"] for e in ev if e["version"] < hit), default=0)
    gap = [v for v in versions if before < v < hit]
    return gap[:: max(1, math.ceil(len(gap) / most))]


def evaluate_runs(res: dict[str, Any], store_url: str, threshold: float) -> None:
    """Each run's versions on the grid (and those the on-policy comparison needs), then the threshold's
    crossing read between the grid's versions (`refine`); with the stack stopped, off every clock."""
    for x in res["runs"]:
        vb = x["version_billable"]
        on_policy = max(  # the same round's windowed run: the on-policy comparison's versions
            (
                p["step"]
                for r in res["runs"]
                if r["setup"] == "windowed" and r["round"] == x["round"]
                for p in r["points"]
            ),
            default=0,
        )
        also = tuple(range(on_policy - 2, on_policy + 1))
        times = {v: vb[v] for v in eval_versions(sorted(vb), also)}
        te = time.time()
        x["evals"] = evaluate_versions(str(MODEL), TASK, store_url, x["job_id"], times)
        extra = refine(sorted(vb), x["evals"], threshold)
        if extra:
            more = evaluate_versions(str(MODEL), TASK, store_url, x["job_id"], {v: vb[v] for v in extra})
            x["evals"] = sorted(x["evals"] + [e for e in more if e["version"] in extra], key=lambda e: e["version"])
            times.update({v: vb[v] for v in extra})
        for e in x["evals"]:
            e["billable_s"] = e["t"]
        print(
            f"{x['setup']} (round {x['round']}): evaluated {len(times)} versions in {time.time() - te:.0f}s", flush=True
        )
