"""Where a benchmark's results go, and the headline figures it exports from them.

A benchmark run with `--out bench/results/<name>.md` writes its page there and its raw results
beside it as <name>.json, an object that also holds:
- `command`: the command that produced it (run from the repository root);
- `machine`: where it ran (`machine()`) and `date`: when, unless the results carry their own;
- `headline`: its headline figures, rows of `HeadlineRow`, computed by the benchmark from its
  own results.
`make bench` (bench/run_all.py) collects the rows of every results JSON into one index page; it
reads nothing else, so a benchmark's figures are defined in that benchmark alone."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from typing_extensions import TypedDict  # pydantic validates these (bench/run_all.py); typing's needs 3.12

from tests.support import ROOT

RESULTS = ROOT / "bench" / "results"


class Figure(TypedDict):
    """One headline figure as a benchmark states it: what was measured, this side's value and
    the baseline it is read against (text with units), their ratio as the figure's name defines
    it, and the target it is held to, if any."""

    figure: str
    value: str
    baseline: str | None
    ratio: float | None
    target: str | None


class HeadlineRow(Figure):
    """A figure with the command that measured it and the page that explains it."""

    command: str
    page: str


def figure(
    name: str, value: str, baseline: str | None = None, ratio: float | None = None, target: str | None = None
) -> Figure:
    """A headline figure; a ratio that is not a finite number (never reached, nothing measured) is None."""
    finite = ratio is not None and math.isfinite(ratio)
    return {
        "figure": name,
        "value": value,
        "baseline": baseline,
        "ratio": round(ratio, 4) if finite else None,
        "target": target,
    }


def shown_command(script: str, argv: list[str] | None = None) -> str:
    """How a page shows the command that made it: `.venv/bin/python bench/<name>.py` and its arguments
    (this process's by default), quoted, so that an empty argument survives a copy and paste."""
    return shlex.join([".venv/bin/python", str(repo_path(Path(script))), *(sys.argv[1:] if argv is None else argv)])


def table(columns: list[str], rows: Iterable[Iterable[object]]) -> list[str]:
    """A Markdown table's lines: the header, its rule, a line per row."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def headline_rows(figures: list[Figure], command: str, page: Path) -> list[HeadlineRow]:
    return [{**f, "command": command, "page": str(repo_path(page))} for f in figures]


def emit(
    text: str,
    out: Path | None,
    data: dict[str, Any] | None = None,
    *,
    figures: list[Figure] | None = None,
    command: str = "",
) -> None:
    """Print `text`; with `out`, also write it there (folders made) and, when `data` is given, the
    results to the same name with .json: `data` plus `command`, `machine` and `date` (unless `data` has
    its own) and the `figures` as headline rows (values JSON cannot take are written as their str)."""
    print(text)
    if not out:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if data is not None:
        write_json(out, data, figures or [], command)


def write_json(page: Path, data: dict[str, Any], figures: list[Figure], command: str) -> None:
    """The results beside their page (see the module docstring for the fields added)."""
    res = {**data, "command": command, "headline": headline_rows(figures, command, page)}
    res.setdefault("machine", machine())
    res.setdefault("date", dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    page.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")


def repo_path(path: Path) -> Path:
    """`path` as a page names it: from the repository root when it is inside it."""
    path = path.resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def machine() -> str:
    """Where and when this runs, as Markdown bullets: CPU, cores, memory, OS, Python, date, commit, load."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = int(line.split()[1]) / 1024**2
    except OSError:
        pass
    commit, dirty = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain")
    load = os.getloadavg()
    return (
        f"- machine: {cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GB RAM, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}\n"
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
        f"- git commit: {commit or 'unknown'}{' (working tree has uncommitted changes)' if dirty else ''}\n"
        f"- load average (1 / 5 / 15 min): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (the machine is shared; "
        "numbers move with what else runs)"
    )


def _git(*args: str) -> str:
    """git's output in the repository, or "" where there is no git or no repository (a copied tree)."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""
