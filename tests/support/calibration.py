"""The planner's memory model against bench/plan_calibration.py's CPU measurement of one case."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT as REPO


def calibrate(case: dict) -> tuple[float, float]:
    """bench/plan_calibration.py run as its own process on one case, as the bench runs each one:
    (the planner's estimate, the measured peak of tensor bytes)."""
    out = subprocess.run(
        [sys.executable, "bench/plan_calibration.py", "--case", json.dumps(case)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        cwd=REPO,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["estimate"], got["measured"]
