"""Scoring workers do not outlive a killed service.

Regression: every `make test` left three processes behind (a multiprocessing resource tracker and
two spawn workers of shared/domain/scoring.py's pool), reparented to init, after a test
SIGKILLed a reward service. A pool worker holds its call queue's write end itself, so a dead
parent never gives it EOF: it waited forever. Workers now watch for their parent going away.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support import ROOT
from tests.support.stack import wait_for

# A service stand-in: a Scorer's pool started, the pids of its workers and of multiprocessing's
# resource tracker on stdout, then it waits.
SERVICE = """
import os, sys, time
from shared.domain.scoring import Scorer
s = Scorer(2, [])
pool = s._get_pool()
pids = {pool.submit(os.getpid).result(timeout=120) for _ in range(8)}
pids |= set(getattr(pool, "_processes", {}))
from multiprocessing import resource_tracker
tracker = resource_tracker._resource_tracker._pid  # started by the pool's queues (spawn)
print(" ".join(map(str, sorted(pids) + ([tracker] if tracker else []))), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_of_a_sigkilled_service_exit() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) >= 2 and proc.pid not in workers  # at least one worker, and the tracker
        assert all(_alive(p) for p in workers)
        proc.kill()  # the service only, as kill -9 <pid> does: its workers are not signalled
        proc.wait(timeout=30)
        wait_for(
            lambda: not any(_alive(p) for p in workers),
            30,
            "the SIGKILLed service's pool processes to exit",
            poll_s=0.2,
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (the workers, the tracker)
        except ProcessLookupError:
            pass
