"""`make bench`: every benchmark, one after another, then the index of their headline figures.

Each benchmark runs as its own process with the command shown in the index, and writes its page,
its raw results (JSON, with its headline figures) and its plot to bench/results/<name>.*; its log
goes beside them. The stack benchmarks start and stop their own redis-server and services, so only
one stack runs at a time. Ratios inside one benchmark come from items run side by side (A/B
alternating) in that same process. Short settings by default; `--full` runs longer jobs and more
rounds.

The index (bench/results/index.md) is collected from the results JSON alone: every headline row of
every bench/results/*.json, whichever run wrote it. This script knows the benchmarks' commands,
never their figures; `--collect-only` rebuilds the index without running anything.

    .venv/bin/python bench/run_all.py [--full] [--only pipeline,staleness] [--collect-only]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.lab.results import RESULTS, HeadlineRow, machine, repo_path  # noqa: E402

PY = ".venv/bin/python"
# The countup workload's threshold: its SFT model starts near 0.21 held-out and 30 steps at lr 5e-4
# take it to ~0.5 (bench/trl_compare.py --task countup --steps 30), so 0.45 is reached late in the run.
COUNTUP_THRESHOLD = "0.45"


def items(full: bool, results: Path) -> list[tuple[str, list[str]]]:
    """(name, command): each command writes results/<name>.md and its JSON (and plot) beside it."""
    s = {  # short / full settings
        "bus": ["--groups", "400" if full else "200", "--rounds", "21" if full else "15"],
        "pipeline": ["--steps", "16" if full else "10", "--rounds", "3" if full else "2"],
        "staleness": ["--steps", "30" if full else "16", "--rounds", "1"],
        "scaling": ["--steps", "12" if full else "8", "--rounds", "2" if full else "1"],
        "sync": ["--modes", "inprocess,remote", "--versions", "12" if full else "6"],
        "tput": ["--modes", "inprocess,remote" if full else "inprocess", "--prompts", "64", "--rounds", "3"],
        # The trainer needs ~15-40 s to start on a shared 2-core box: on-periods of 50 s (100 s full).
        "backlog": ["--cycles", "2", "--cycle-s", "400" if full else "200", "--rounds", "5" if full else "3"],
    }
    rounds = "3" if full else "2"
    commands = {
        "bus": ["bench/bus.py", *s["bus"]],
        "pipeline": ["bench/pipeline.py", *s["pipeline"]],
        "staleness": ["bench/staleness.py", *s["staleness"]],
        "trl": ["bench/trl_compare.py", "--task", "arith", "--steps", s["staleness"][1], "--threshold", "0.3"]
        + ["--rounds", rounds],
        "trl_countup": ["bench/trl_compare.py", "--task", "countup", "--steps", "30"]
        + ["--threshold", COUNTUP_THRESHOLD, "--rounds", rounds],
        "trainer_passes": ["bench/trainer_passes.py", "--rounds", "7" if full else "5"],
        # B is the tree before the trainer stopped importing an unused bitsandbytes (its page says so).
        "trainer_startup": ["bench/trainer_startup.py", "--baseline", "9061c30", "--rounds", "7" if full else "5"],
        "chunked_logprobs": ["bench/chunked_logprobs.py"],
        "generation": ["bench/generation.py", "--rounds", rounds],
        "sync": ["bench/rollout_sync.py", *s["sync"]],
        "tput": ["bench/rollout_throughput.py", *s["tput"]],
        "scaling": ["bench/scaling.py", *s["scaling"]],
        "verifiers": ["bench/verifiers.py", "--n-math", "200", "--n-code", "32"],
        "omp_wait": ["bench/omp_wait.py", "--rounds", rounds],
        "backlog": ["bench/backlog.py", *s["backlog"]],
        "burst": ["bench/burst.py", *(["--full"] if full else [])],
        "tinker_overhead": ["bench/tinker_overhead.py", "--steps", "16" if full else "10"],
        "tinker_rl": ["bench/tinker_rl.py", "--steps", "16"],
        "load": ["bench/load.py", "--jobs", "20", "--steps", "6", "--replicas", "1,2"],
    }
    return [(name, [PY, *cmd, "--out", str(results / f"{name}.md")]) for name, cmd in commands.items()]


def headline(path: Path) -> list[HeadlineRow]:
    """The headline rows of one results JSON, checked: a row that lacks a field or has one of the
    wrong type stops the index with the file, the row and the field to fix."""
    from pydantic import TypeAdapter, ValidationError

    data = json.loads(path.read_text())
    try:
        return TypeAdapter(list[HeadlineRow]).validate_python(data.get("headline", []))
    except ValidationError as e:
        where = "; ".join(
            f"row {err['loc'][0]}, field {'.'.join(map(str, err['loc'][1:]))}: {err['msg']}" for err in e.errors()
        )
        raise SystemExit(f"{repo_path(path)}: bad headline ({where})") from None


def collect(results: Path, order: list[str]) -> list[tuple[Path, dict[str, Any], list[HeadlineRow]]]:
    """Every results JSON with headline rows: the benchmarks of `order` first, in that order, then the
    rest by name (other runs of a benchmark, such as bench/burst.py's pages of other setups)."""
    found = []
    for path in sorted(results.glob("*.json")):
        rows = headline(path)
        if rows:
            found.append((path, json.loads(path.read_text()), rows))
    rank = {name: i for i, name in enumerate(order)}
    return sorted(found, key=lambda f: (rank.get(f[0].stem, len(rank)), f[0].stem))


def ratio(x: float | None) -> str:
    return "" if x is None else f"**{x:.2f}x**"


def index(results: Path, order: list[str], header: str, timings: list[str]) -> str:
    """The index page: every headline row, then each page with its command, run date and plot."""
    found = collect(results, order)
    figures = [
        f"| {r['figure']} | {r['value']} | {r['baseline'] or ''} | {ratio(r['ratio'])} | {r['target'] or ''} "
        f"| [{path.stem}]({path.stem}.md) |"
        for path, _, rows in found
        for r in rows
    ]
    pages = []
    for path, data, rows in found:
        plot = path.with_suffix(".png")
        shown = f"[{plot.name}]({plot.name})" if plot.exists() else ""
        pages.append(f"| [{path.stem}]({path.stem}.md) | `{rows[0]['command']}` | {data.get('date', '')} | {shown} |")
    doc = [
        "# burstrl benchmarks",
        "",
        "Collected by `.venv/bin/python bench/run_all.py` from the results in bench/results/: each benchmark "
        "writes its page, its raw results (JSON) and its headline figures there, and this page gathers the "
        "figures, nothing else. A figure's page says how it was measured and how to read it; its command "
        "reproduces it (from the repository root). Pages were run on different days and machines (the "
        "table of pages says when, each page where): compare figures within one page.",
        "",
        header,
        "",
        "## Headline figures",
        "",
        "| figure | value | baseline | ratio | target | page |",
        "|---|---|---|---|---|---|",
        *figures,
        "",
        "## Pages",
        "",
        "| page | command | run | plot |",
        "|---|---|---|---|",
        *pages,
        "",
    ]
    if timings:
        doc += ["## Run log", "", "| benchmark | seconds | result |", "|---|---|---|", *timings, ""]
    return "\n".join(doc)


def run(name: str, cmd: list[str], results: Path, timeout: float) -> str:
    """One benchmark as its own process, its output in results/<name>.log: its run-log row."""
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    log = results / f"{name}.log"
    t0 = time.time()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    secs = time.time() - t0
    print(f"   {name}: rc {rc} in {secs:.0f}s", flush=True)
    if rc == 0:
        return f"| {name} | {secs:.0f} | ok |"
    tail = " / ".join(log.read_text(errors="replace").splitlines()[-3:]).replace("|", "/")
    return f"| {name} | {secs:.0f} | FAILED (rc {rc}, see {log.name}): {tail[:300]} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [n for n, _ in items(False, RESULTS)]
    ap.add_argument("--full", action="store_true", help="Longer jobs and more rounds.")
    ap.add_argument("--only", default="", help="Comma-separated subset: " + ", ".join(names))
    ap.add_argument("--results", type=Path, default=RESULTS, help="Where the results are (and go).")
    ap.add_argument(
        "--collect-only", action="store_true", help="Run nothing: rebuild the index from the results as they are."
    )
    ap.add_argument("--timeout", type=float, default=1800, help="Per benchmark, seconds.")
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    if bad := only - set(names):
        ap.error(f"--only: unknown {sorted(bad)}; known: {', '.join(names)}")
    results = a.results.resolve()
    results.mkdir(parents=True, exist_ok=True)
    timings = []
    if not a.collect_only:
        header = "This run of `make bench`:\n\n" + machine()
        for name, cmd in items(a.full, repo_path(results)):
            if not only or name in only:
                timings.append(run(name, cmd, results, a.timeout))
    else:
        header = "Collected without running anything (`--collect-only`)."
    out = results / "index.md"
    out.write_text(index(results, names, header, timings))
    print(f"wrote {repo_path(out)}")


if __name__ == "__main__":
    main()
