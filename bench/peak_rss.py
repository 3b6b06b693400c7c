"""Peak resident memory of each service of a running stack, until the stack stops.

Watches the processes a stack under `--home` started (its run/procs.json: `burstrl up`, `burstrl
demo`, bench/smollm2_demo.py), every `--every` seconds, until all have exited, and writes per role:
- the service process's own peak RSS (the kernel's VmHWM, read at the last sample before it
  exited: a high-water mark, so nothing between samples is missed);
- the peak, over the samples, of the RSS of the process and all its descendants summed (reward's
  scoring workers, vLLM's helpers): shared pages count once per process, so this is an upper bound.

Start it beside the stack (it waits for the stack's procs.json):

    PYTHONPATH=. .venv/bin/python bench/smollm2_demo.py --out bench/results/smollm2_demo.md &
    PYTHONPATH=. .venv/bin/python bench/peak_rss.py --home /tmp/smollm2-demo-XXXX --label "SmolLM2 demo" \\
        --out bench/results/smollm2_memory.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.lab.results import emit, figure, machine, shown_command, table  # noqa: E402


def status_kb(pid: int, field: str) -> int | None:
    """A `VmHWM:`/`VmRSS:` line of /proc/<pid>/status in kB; None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return 0


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", type=Path, required=True, help="the stack's home (its run/ folder holds procs.json)")
    ap.add_argument("--label", default="the stack", help="what ran (the page's title)")
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    run = args.home / "run"
    while not (run / "procs.json").exists():
        time.sleep(args.every)
    time.sleep(args.every)  # the stack writes it as each service starts
    # Read once, never through Launcher (which makes folders): the stack's owner removes its home
    # when it stops, and nothing here may race that.
    pids = {role: int(p["pid"]) for role, p in json.loads((run / "procs.json").read_text()).items()}
    hwm: dict[str, int] = {}
    tree: dict[str, int] = {}
    while True:
        live = 0
        for role, pid in pids.items():
            own = status_kb(pid, "VmHWM")
            if own is None:
                continue
            live += 1
            hwm[role] = max(hwm.get(role, 0), own)
            total = sum(status_kb(q, "VmRSS") or 0 for q in [pid, *descendants(pid)])
            tree[role] = max(tree.get(role, 0), total)
        if not live and hwm:
            break
        time.sleep(args.every)
    command = shown_command(__file__)
    rows = [(r, f"{hwm[r] / 1024:.0f}", f"{tree[r] / 1024:.0f}") for r in sorted(hwm)]
    text = "\n".join(
        [
            f"## Peak RSS per service: {args.label}",
            "",
            f"`{command}`",
            "",
            *table(["service", "peak RSS, the process (MiB)", "peak RSS, with its child processes (MiB)"], rows),
            "",
            "The process's own peak is the kernel's high-water mark (VmHWM); with its children, the largest sum "
            f"of RSS seen in samples every {args.every:g} s (shared pages counted once per process).",
            "",
            machine(),
        ]
    )
    figs = [figure(f"peak RSS of {r} ({args.label}), MiB", f"{hwm[r] / 1024:.0f}") for r in sorted(hwm) if r != "redis"]
    data = {"label": args.label, "peak_rss_kb": hwm, "peak_tree_rss_kb": tree}
    emit(text + "\n", args.out, data, figures=figs, command=command)


if __name__ == "__main__":
    main()
