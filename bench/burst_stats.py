"""Pure readings of bench/burst.py's runs, shared by its page (bench/burst_report.py) and its
quota calibration (bench/burst_quota.py): the trainer's and rollout's rates, k, and the ratios
of billable seconds to the threshold that pair runs of one round."""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.burst_setups import RATE_SETUPS


def _sessions(x: dict[str, Any]) -> list[tuple[float, float, list[dict[str, Any]]]]:
    """A run's trainer sessions: (spawned, reaped, the steps it made in between)."""
    return [(a, b, [p for p in x["points"] if a <= p["at"] <= b]) for a, b in x["trainer_intervals"]]


def _busy_s(p: dict[str, Any]) -> float:
    return p["train_s"] + p["publish_s"] + p["checkpoint_s"]


def trainer_gps(steps: list[dict[str, Any]]) -> float:
    """Groups the trainer trained per second of its steps' busy time (train, publish, checkpoint)."""
    busy = sum(_busy_s(p) for p in steps)
    return sum(p["groups"] for p in steps) / busy if busy else float("nan")


def rates(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Trainer and rollout groups/s measured in the backlog runs (no replica), start-up seconds,
    and teardown seconds (the drained sessions': the last step's end to the process gone)."""
    bl = [x for x in runs if x["setup"] in RATE_SETUPS]
    steps, starts, teardowns = [], [], []
    for x in runs:
        if x["setup"] == "trl":
            continue
        for a, b, pts in _sessions(x):
            if not pts:
                continue
            starts.append(pts[0]["at"] - _busy_s(pts[0]) - a)
            if x in bl:
                steps += pts[1:]  # the session's first step waits on the fetch
                if b - a < x.get("window_s", math.inf) - 1:  # it left before the window closed
                    teardowns.append(b - pts[-1]["at"])
    trainer = trainer_gps(steps)
    rollout = sum(x["groups_made"] for x in bl) / sum(x["wall_s"] for x in bl) if bl else float("nan")
    return {
        "trainer_gps": round(trainer, 2),
        "rollout_gps": round(rollout, 2),
        "k": round(trainer / rollout, 2) if rollout else float("nan"),
        "startup_s": round(statistics.median(starts), 1) if starts else float("nan"),
        "startup_range_s": [round(min(starts), 1), round(max(starts), 1)] if starts else [],
        "teardown_s": round(statistics.median(teardowns), 1) if teardowns else 0.0,
        "teardown_range_s": [round(min(teardowns), 1), round(max(teardowns), 1)] if teardowns else [],
    }


def near(evals: list[dict[str, Any]], version: int, width: int = 2) -> float | None:
    """Mean held-out accuracy of versions version-width .. version (less noise than one)."""
    xs = [e["accuracy"] for e in evals if version - width <= e["version"] <= version]
    return round(statistics.fmean(xs), 4) if xs else None


def rounds_of(runs: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """The runs by round, then by setup: a round runs each setup once, side by side."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for x in runs:
        out.setdefault(x.get("round", 0), {})[x["setup"]] = x
    return dict(sorted(out.items()))


def round_ratios(runs: list[dict[str, Any]], key: str, other: str) -> list[tuple[float, bool]]:
    """Per round that ran both: key's billable seconds to the threshold over other's, and whether
    that is exact. inf where key never reached it; where only other never did, key's seconds over
    other's whole billable seconds, an upper bound (False). Ratios pair runs of one round only, so
    each compares setups measured side by side."""
    out = []
    for by in rounds_of(runs).values():
        m, o = by.get(key), by.get(other)
        if not (m and o):
            continue
        mt, ot = m["to_threshold"], o["to_threshold"]
        if mt is None:
            out.append((math.inf, True))
        elif ot is None:
            out.append((mt / o["billable_s"], False))
        else:
            out.append((mt / ot, True))
    return out


def ratios_text(rs: list[tuple[float, bool]]) -> str:
    """round_ratios as the page shows them: "never" where key never reached the threshold, "< " before
    an upper bound."""
    return ", ".join("never" if math.isinf(v) else f"{'' if exact else '< '}{v:.2f}x" for v, exact in rs)


def ratios_summary(rs: list[tuple[float, bool]]) -> tuple[str, float]:
    """round_ratios as shown (ratios_text) and their median, the number a target is judged on."""
    return ratios_text(rs), statistics.median(v for v, _ in rs)


def onpolicy_diffs(runs: list[dict[str, Any]], key: str) -> list[tuple[int, float, float, float]]:
    """Per round that ran both: (n, key's accuracy, windowed's, their difference) at the windowed run's
    last version n, each the mean of versions n-2..n (`near`): learning at the same trained groups
    against on-policy (windowed, max_staleness 1)."""
    out = []
    for by in rounds_of(runs).values():
        m, w = by.get(key), by.get("windowed")
        if not (m and w and w["points"]):
            continue
        n = max(p["step"] for p in w["points"])
        am, aw = near(m["evals"], n), near(w["evals"], n)
        if am is not None and aw is not None:
            out.append((n, am, aw, am - aw))
    return out


def peak(evals: list[dict[str, Any]]) -> str:
    e = max(evals, key=lambda e: (e["accuracy"], -e["version"]))
    return f"{e['accuracy']:.3f} (v{e['version']}, {e['t']:.1f} s)"


def fmt(x: float | None, unit: str = "", nd: int = 1) -> str:
    return "never" if x is None else ("inf" if math.isinf(x) else f"{x:.{nd}f}{unit}")
