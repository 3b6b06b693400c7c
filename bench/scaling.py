"""Scaling: two rollout replicas against one, in the same consumer group.

One stack with two rollout services (each its own vLLM engine, port and adapter cache).
"One replica" pauses the second (SIGSTOP of its process group, so it takes no entries);
"two" runs both. Rounds alternate one / two. Measured, each round:
- rollout alone: groups/s the rollout replicas turn a full prompt queue into (the other
  stages paused; tests/support/lab/stages.py);
- end-to-end: trained groups/s of the demo-shaped job (eval off).
On a 2-core machine two engines compete for the same cores, so the point is that the
replicas share the work correctly, and what it costs or gains, not the absolute number.

    .venv/bin/python bench/scaling.py [--steps 12] [--rounds 2] [--out bench/results/scaling.md]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.lab.jobs import DEMO_SHAPE  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402
from tests.support.lab.stack import MODEL, Stack, run_job  # noqa: E402
from tests.support.lab.stages import stages_alone  # noqa: E402


def groups_made(st: Stack) -> dict[str, int]:
    """Each rollout replica's own count of groups produced (its Prometheus counter)."""
    out = {}
    for name in ("rollout", "rollout2"):
        text = httpx.get(f"http://127.0.0.1:{st.ports[name]}/metrics", timeout=10).text
        line = next((ln for ln in text.splitlines() if ln.startswith("burstrl_rollout_groups_total")), "x 0")
        out[name] = int(float(line.split()[-1]))
    return out


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: two replicas against one, rollout alone and end-to-end."""
    med = {n: {k: statistics.median(v) for k, v in x.items()} for n, x in res["results"].items()}
    return [
        figure(
            f"2 / 1 rollout replicas, {what}",
            f"{med['2'][k]:.2f} groups/s",
            baseline=f"{med['1'][k]:.2f} groups/s with one",
            ratio=med["2"][k] / med["1"][k],
        )
        for k, what in (("alone", "rollout alone"), ("e2e", "end-to-end"))
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", type=Path, default=None, help="Markdown here; .json beside it.")
    a = ap.parse_args()
    cmd = shown_command(__file__)
    res: dict[int, dict[str, list[float]]] = {1: {"alone": [], "e2e": []}, 2: {"alone": [], "e2e": []}}
    share: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory(prefix="burstrl-scale-") as tmp, Stack(Path(tmp), a.model, rollouts=2) as st:
        for k in range(a.rounds):
            for n in (1, 2) if k % 2 == 0 else (2, 1):
                held = ("rollout2",) if n == 1 else ()
                for h in held:
                    st.signal(h, signal.SIGSTOP)
                try:
                    rates = stages_alone(st, a.steps, stages=("rollout",), held=held)
                    res[n]["alone"].append(rates["rollout"])
                    before = groups_made(st) if n == 2 else {}  # a paused replica cannot answer
                    job = run_job(st, {**DEMO_SHAPE, "name": f"scale{n}", "steps": a.steps, "eval_size": 0})
                    res[n]["e2e"].append(job["groups_per_s"])
                    if n == 2:  # which replica made the groups of this job
                        share.append({k: v - before[k] for k, v in groups_made(st).items()})
                finally:
                    for h in held:
                        st.signal(h, signal.SIGCONT)
                print(f"round {k} replicas {n}: alone {res[n]['alone'][-1]} e2e {res[n]['e2e'][-1]}", flush=True)
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in res.items()}
    lines = [
        "## Scaling: rollout replicas",
        "",
        f"`{cmd}` — {a.rounds} alternating rounds, {a.steps} steps x 8 groups x G=16, eval off.",
        "",
        "| rollout replicas | rollout alone groups/s | end-to-end trained groups/s |",
        "|---|---|---|",
    ]
    for n in (1, 2):
        lines.append(
            f"| {n} | {med[n]['alone']:.2f} ({', '.join(f'{x:.2f}' for x in res[n]['alone'])}) | "
            f"{med[n]['e2e']:.2f} ({', '.join(f'{x:.2f}' for x in res[n]['e2e'])}) |"
        )
    lines += [
        "",
        f"**2 / 1 replicas: rollout alone {med[2]['alone'] / med[1]['alone']:.2f}x, "
        f"end-to-end {med[2]['e2e'] / med[1]['e2e']:.2f}x** (2 CPU cores shared by both engines).",
        f"Groups made per replica in the two-replica end-to-end jobs: {share}.",
        "",
    ]
    data = json.loads(json.dumps({"results": res, "share": share}))  # replica counts as JSON keys, as read back
    emit("\n".join(lines), a.out, data, figures=figures(data), command=cmd)


if __name__ == "__main__":
    main()
