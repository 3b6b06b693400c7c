"""A pytest plugin: every test's start and end wall time, one JSON line each, one file per
xdist worker, so a suite's packing across workers can be read off afterwards (bench/results/suite_cpu.md).

    TIMELINE_DIR=/tmp/tl .venv/bin/python -m pytest -p bench.pytest_timeline -n 2 --dist loadfile tests/...
    .venv/bin/python bench/pytest_timeline.py /tmp/tl     # per worker: files, their spans, the longest

Not a test and not imported by one: it is loaded by name (-p) only when asked for.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO

_out: IO[str] | None = None


def _file() -> IO[str]:
    global _out
    if _out is None:
        d = Path(os.environ.get("TIMELINE_DIR", "timeline"))
        d.mkdir(parents=True, exist_ok=True)
        _out = (d / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl").open("a", buffering=1)
    return _out


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _file().write(json.dumps({"id": nodeid, "ev": "start", "t": time.time()}) + "\n")


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _file().write(json.dumps({"id": nodeid, "ev": "end", "t": time.time()}) + "\n")


def summary(d: Path, top: int = 15) -> str:
    """Per worker: its files' spans (first start to last end), and the longest files overall."""
    rows: list[tuple[str, str, float, float]] = []
    for f in sorted(d.glob("*.jsonl")):
        spans: dict[str, list[float]] = {}
        for line in f.read_text().splitlines():
            e = json.loads(line)
            s = spans.setdefault(e["id"].split("::")[0], [e["t"], e["t"]])
            s[0], s[1] = min(s[0], e["t"]), max(s[1], e["t"])
        rows += [(f.stem, name, a, b) for name, (a, b) in spans.items()]
    if not rows:
        return f"no timeline in {d}"
    t0 = min(r[2] for r in rows)
    out = [f"span {(max(r[3] for r in rows) - t0) / 60:.2f} min"]
    for w in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == w]
        out.append(f"{w}: {len(mine)} files, last end at {(max(r[3] for r in mine) - t0) / 60:.2f} min")
    for w, name, a, b in sorted(rows, key=lambda r: r[2] - r[3])[:top]:
        out.append(f"{w} {name} {b - a:.1f} s, from {(a - t0) / 60:.2f} min")
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "timeline")))
