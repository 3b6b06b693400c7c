"""A burst trainer's start-up, side by side: this tree against a baseline revision.

A burst pays for the trainer from its spawn, so every second between `python -m services.trainer`
and its first read of groups is billed in every burst and every restart (issue 20's billable
seconds). One redis-server and the api on free ports, one job (no rollout: nothing to train, so
the trainer is timed only up to being ready); then the trainer is started from this tree (A) and
from a git worktree of `--baseline` (B), in turn, A B A B ... Each run is timed from its spawn to its
session's "start" point (job leased, model loaded, optimizer built, checkpoint restored: it reads
next), then stopped with SIGTERM. The ratio A/B is taken pair by pair.

    .venv/bin/python bench/trainer_startup.py --baseline 9061c30 --rounds 7 --out bench/results/trainer_startup.md
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cli.launch import free_port  # noqa: E402
from shared.metrics import read_session_points  # noqa: E402
from tests.support.lab.jobs import BURST_JOB  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, machine  # noqa: E402
from tests.support.lab.stack import Stack, submit  # noqa: E402


def start_once(stack: Stack, tree: Path, job_id: str, epoch: int, timeout: float = 300) -> dict[str, float]:
    """Spawn the trainer from `tree`, wait for its session's start point (epoch > `epoch`), stop it."""
    env = {**os.environ, **stack.env, "BURSTRL_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    log = open(stack.home / "trainer-runs.log", "ab")  # noqa: SIM115 (closed below)
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.trainer"],
        cwd=tree,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        while True:
            starts = [
                p for p in read_session_points(stack.r, job_id) if p.get("event") == "start" and p["epoch"] > epoch
            ]
            if starts:
                p = starts[-1]
                return {"ready_s": p["at"] - t0, "interpreter_s": p["process_start"] - t0, "epoch": p["epoch"]}
            if proc.poll() is not None or time.time() - t0 > timeout:
                raise SystemExit(f"trainer from {tree} exited or hung (rc {proc.poll()}); see {log.name}")
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the git revision B is checked out at")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    base = subprocess.run(["git", "rev-parse", "--short", a.baseline], cwd=ROOT, capture_output=True, text=True)
    if base.returncode:
        raise SystemExit(f"--baseline {a.baseline!r}: not a revision here ({base.stderr.strip()})")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(wt), a.baseline], cwd=ROOT, check=True)
        try:
            with Stack(Path(tmp) / "home", roles=["api"]) as stack:
                job_id = submit(stack, {**BURST_JOB, "name": "startup"})
                epoch = 0
                for i in range(a.rounds):
                    for side, tree in (("A", ROOT), ("B", wt)):
                        got = start_once(stack, tree, job_id, epoch)
                        epoch = int(got["epoch"])
                        rows.append({"round": i, "side": side, **got})
                        print(f"round {i} {side}: ready {got['ready_s']:.2f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
    text = report(rows, a, base.stdout.strip())
    cmd = command(a)
    data = {"rows": rows, "baseline": base.stdout.strip()}
    emit(text, a.out, data, figures=figures(data), command=cmd)


def pair_ratios(rows: list[dict]) -> list[float]:
    """A/B spawn-to-ready, pair by pair (A and B alternate, A first)."""
    sides = ([r for r in rows if r["side"] == s] for s in ("A", "B"))
    return [a_["ready_s"] / b_["ready_s"] for a_, b_ in zip(*sides, strict=True)]


def figures(res: dict) -> list[Figure]:
    """The headline figure of a results JSON: this tree's spawn to ready over the baseline's."""
    rows = res["rows"]

    def med(side: str) -> float:
        return statistics.median(r["ready_s"] for r in rows if r["side"] == side)

    return [
        figure(
            f"trainer spawn to ready, this tree / {res['baseline']}, median of pairs",
            f"{med('A'):.2f} s",
            baseline=f"{med('B'):.2f} s at {res['baseline']}",
            ratio=statistics.median(pair_ratios(rows)),
        )
    ]


def command(a: argparse.Namespace) -> str:
    out = f" --out {a.out}" if a.out else ""
    return f".venv/bin/python bench/trainer_startup.py --baseline {a.baseline} --rounds {a.rounds}{out}"


def report(rows: list[dict], a: argparse.Namespace, base: str) -> str:
    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["side"] == side)

    ratios = pair_ratios(rows)
    lines = [
        "## A burst trainer's start-up: spawn to ready (issue 20's billable seconds)",
        "",
        f"`{command(a)}`",
        "",
        machine(),
        "",
        f"A: this tree; B: {base}. Spawn to the session's start point (leased, model loaded, ready to read), "
        f"median of {a.rounds} runs each, A and B in turn; the trainer is stopped there (no rollout, nothing "
        "to train). The tiny model, CPU, one trainer thread.",
        "",
        "| | A (this tree) | B (baseline) |",
        "|---|---|---|",
        f"| spawn to ready, median s | {med('A', 'ready_s'):.2f} | {med('B', 'ready_s'):.2f} |",
        f"| of which spawn to the interpreter's start, median s | {med('A', 'interpreter_s'):.2f} | "
        f"{med('B', 'interpreter_s'):.2f} |",
        "",
        f"A/B, spawn to ready, pair by pair: {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"**median {statistics.median(ratios):.2f}x**.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
