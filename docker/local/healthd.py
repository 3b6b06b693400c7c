#!/usr/bin/env python3
"""Run podman's healthchecks on a host without systemd.

podman schedules each container's HEALTHCHECK with a systemd timer; where systemd is not PID 1
(containers, CI sandboxes) no timer exists, every container stays "starting" forever, and
compose's `depends_on: condition: service_healthy` never lets anything start. This daemon does
the timers' job: every container of the given compose projects that has a healthcheck gets
`podman healthcheck run` once per its own interval (podman then applies start period, retries and
timeout itself, so health reads the same as under Docker).

    healthd.py PROJECT [PROJECT...]      # until SIGTERM; standard library only
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

POLL_S = 1.0


def containers(project: str) -> list[str]:
    out = subprocess.run(
        ["podman", "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.split()


def healthcheck(cid: str) -> tuple[float, float] | None:
    """(interval, timeout) in seconds, or None without a healthcheck."""
    out = subprocess.run(
        ["podman", "inspect", "--format", "{{json .Config.Healthcheck}}", cid],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0 or out.stdout.strip() in ("", "null"):
        return None
    hc = json.loads(out.stdout)
    test = hc.get("Test") or []
    if not test or test[0] == "NONE":
        return None
    # podman reports nanoseconds, as Docker does; 30 s is both engines' default interval.
    interval = (hc.get("Interval") or 30_000_000_000) / 1e9
    timeout = (hc.get("Timeout") or 30_000_000_000) / 1e9
    return interval, timeout


def main(projects: list[str]) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    known: dict[str, tuple[float, float] | None] = {}
    due: dict[str, float] = {}
    running: dict[str, threading.Thread] = {}

    def run_check(cid: str, timeout: float) -> None:
        try:  # exit status 1 = unhealthy: podman has recorded it; nothing to do here
            subprocess.run(["podman", "healthcheck", "run", cid], capture_output=True, timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            pass

    while not stop.is_set():
        live = {cid for p in projects for cid in containers(p)}
        for cid in live:
            if cid not in known:
                known[cid] = healthcheck(cid)
                due[cid] = time.monotonic()  # Docker's first check comes one interval after start
                if known[cid]:
                    due[cid] += known[cid][0]
            hc = known[cid]
            busy = cid in running and running[cid].is_alive()
            if hc and not busy and time.monotonic() >= due[cid]:
                due[cid] = time.monotonic() + hc[0]
                running[cid] = threading.Thread(target=run_check, args=(cid, hc[1]), daemon=True)
                running[cid].start()
        for cid in set(known) - live:  # gone, or restarted under the same id: start afresh
            known.pop(cid, None)
            due.pop(cid, None)
        stop.wait(POLL_S)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
