"""Async vs sync: the same GRPO job with max_staleness 0, 1 and 2 — speed and final accuracy.

One stack; the demo's job shape (G 16, batch 8, lr 1e-3, KL 0.001, eval 64 held-out
prompts x 4 samples per version) with only max_staleness changed. With 0 the pipeline is
synchronous: rollout may only sample from the newest version, so it waits for every
optimizer step (and the trainer for every batch). Jobs run one after another, the order
reversed in alternate rounds so drift on the shared machine hits all settings alike.

    .venv/bin/python bench/staleness.py [--steps 20] [--rounds 1] [--out bench/results/staleness.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.lab.jobs import DEMO_SHAPE  # noqa: E402
from tests.support.lab.plots import accuracy_curves  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402
from tests.support.lab.stack import MODEL, Stack, run_job  # noqa: E402


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    t0 = res["submitted_at"]
    evals = [{"version": e["version"], "t": round(e["at"] - t0, 2), "accuracy": e["accuracy"]} for e in res["evals"]]
    return {
        "job_id": res["job_id"],
        "wall_s": round(res["trained_at"] - t0, 2),
        "groups_per_s": res["groups_per_s"],
        "final_acc": res["evals"][-1]["accuracy"] if res["evals"] else None,
        "final_greedy": res["evals"][-1].get("greedy_accuracy") if res["evals"] else None,
        "dropped_stale": res["ledger"].get("dropped_stale", 0),
        "idle_frac": round(statistics.median(p["idle_frac"] for p in res["points"]), 3),
        "evals": evals,
    }


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: each setting's speed-up over the first (wall
    seconds from submission to the last step, medians over rounds)."""
    walls = {int(s): statistics.median(r["wall_s"] for r in rs) for s, rs in res["runs"].items()}
    first, *rest = res["settings"]
    base = f"{walls[first]:.1f} s at max_staleness {first}"
    return [
        figure(f"speed-up max_staleness {s} vs {first}", f"{walls[s]:.1f} s", base, walls[first] / walls[s])
        for s in rest
    ]


def plot(runs: dict[int, list[dict[str, Any]]], png: Path) -> None:
    curves = [(f"max_staleness {s}", rs[-1]["evals"]) for s, rs in sorted(runs.items())]
    accuracy_curves(curves, png, xlabel="seconds since submission", title="async vs sync (last round)", marker_size=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--staleness", default="0,1,2")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", type=Path, default=None, help="Markdown here; .json and .png beside it.")
    a = ap.parse_args()
    cmd = shown_command(__file__)
    settings = [int(x) for x in a.staleness.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="burstrl-stale-") as tmp, Stack(Path(tmp), a.model) as stack:
        for k in range(a.rounds):
            for s in settings if k % 2 == 0 else settings[::-1]:
                spec = {**DEMO_SHAPE, "name": f"stale{s}", "steps": a.steps, "max_staleness": s}
                runs[s].append(summarize(run_job(stack, spec)))
                print(f"staleness {s}: {json.dumps({k: v for k, v in runs[s][-1].items() if k != 'evals'})}")
    base = statistics.median(r["wall_s"] for r in runs[settings[0]])
    lines = [
        "## Async vs sync (max_staleness)",
        "",
        f"`{cmd}` — {a.steps} steps x 8 groups x G=16, {a.rounds} round(s), medians over rounds.",
        "",
        "| max_staleness | wall s (submit -> last step) | speed-up vs "
        f"{settings[0]} | groups/s | final held-out acc (T=1) | final greedy acc | dropped stale | trainer idle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in settings:
        rs = runs[s]
        wall = statistics.median(r["wall_s"] for r in rs)
        lines.append(
            f"| {s} | {wall:.1f} | {base / wall:.2f}x | {statistics.median(r['groups_per_s'] for r in rs):.2f} | "
            f"{statistics.median(r['final_acc'] for r in rs):.3f} | "
            f"{statistics.median(r['final_greedy'] for r in rs):.3f} | "
            f"{statistics.median(r['dropped_stale'] for r in rs):.0f} | "
            f"{statistics.median(r['idle_frac'] for r in rs):.2f} |"
        )
    lines.append("")
    data = {"settings": settings, "runs": runs}
    emit("\n".join(lines), a.out, data, figures=figures(data), command=cmd)
    if a.out:
        plot(runs, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
