"""Where a command's CPU goes, by kind of process: the test suite's budget, measured.

    python3 bench/cpu_profile.py [--out FILE.json] [--interval 1] -- make test

Runs the command and, every `--interval` seconds until it exits, reads every process's
cumulative CPU (utime + stime from /proc/PID/stat) and its command line. At the end it prints the
CPU seconds of each kind of process (a pytest process, `services.rollout`, vLLM's OpenAI server,
multiprocessing children, ...) with how many there were, against the command's wall time: on
a 2-core box the wall time can never be below half the total. Stdlib only, so it can wrap
`bash .ci/run` before the venv exists.

Processes that were already running count only the CPU they use while the command runs. What
it misses: processes that live less than one interval, and a process's last interval
before it exits (both small for a suite of long-lived services). The box's own daemons are in
the table too, under their own names: they compete for the same cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def sample(seen: dict[str, dict], t: float) -> None:
    """One pass over /proc: each process's CPU so far, keyed by pid and start time (pids recur)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            rest = stat[stat.rfind(")") + 2 :].split()
            cpu = (int(rest[11]) + int(rest[12])) / TICK
            key = f"{name}:{rest[19]}"
            if key not in seen:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                # a process already running when the command started counts from here on
                seen[key] = {"cmd": cmd[:300], "ppid": int(rest[1]), "first": t, "cpu0": cpu if t < 0 else 0.0}
            seen[key].update(cpu=cpu, last=t)
        except (OSError, IndexError, ValueError):
            continue  # gone between listdir and read


def kind(cmd: str) -> str | None:
    """The row a process is counted under (None: this profiler itself)."""
    if "cpu_profile.py" in cmd:
        return None
    if "multiprocessing.spawn" in cmd or "multiprocessing.resource_tracker" in cmd:
        return "multiprocessing children (vLLM engines, scoring pools, gloo ranks)"
    m = re.search(r"-m (services\.\w+|vllm\.entrypoints\.[\w.]+|moto\.\w+)", cmd)
    if m:
        return m.group(1)
    if "exec(eval(sys.stdin.readline()))" in cmd or "pytest" in cmd:
        return "pytest processes (tests in-process, model builds)"
    for name in ("redis-server", "chromium", "bench/chaos.py", "bench/plan_calibration.py"):
        if name in cmd:
            return name
    return "other: " + (cmd.split(" ")[0][-50:] or "(kernel threads)")


def table(seen: dict[str, dict], wall: float) -> str:
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for p in seen.values():
        k = kind(p["cmd"])
        used = p.get("cpu", 0.0) - p["cpu0"]
        if k is not None and used > 0:
            rows[k][0] += used
            rows[k][1] += 1
    total = sum(r[0] for r in rows.values())
    cores = os.cpu_count() or 1
    out = [
        f"wall {wall / 60:.1f} min; CPU {total / 60:.1f} min over {cores} cores "
        f"(the wall time cannot be below {total / cores / 60:.1f} min)",
        "",
        "| processes | CPU min | share | count (that used CPU) |",
        "|---|---|---|---|",
    ]
    for k, (cpu, n) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        if cpu >= 0.005 * total:
            out.append(f"| {k} | {cpu / 60:.2f} | {cpu / total:.0%} | {n} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="Every process's CPU, command line and lifetime, as JSON.")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command to profile after --, e.g. -- make test")
    if a.interval <= 0:
        ap.error("--interval must be > 0 seconds")
    seen: dict[str, dict] = {}
    sample(seen, -1.0)  # what runs already: its CPU before the command is not the command's
    start = time.time()
    proc = subprocess.Popen(cmd)
    try:
        while proc.poll() is None:
            sample(seen, time.time() - start)
            time.sleep(a.interval)
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
    wall = time.time() - start
    report = table(seen, wall)
    print(f"\n$ {' '.join(cmd)}  (exit {proc.returncode})\n{report}", file=sys.stderr)
    if a.out:
        a.out.write_text(json.dumps({"command": cmd, "wall_s": wall, "rc": proc.returncode, "processes": seen}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
