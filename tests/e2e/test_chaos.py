"""Chaos, shortened (`make chaos` runs the long one): a real job through the five real services
while every service is kill -9'd once, Redis is kill -9'd and restarted from its AOF, the
object store goes away for a while, a corrupt and a partial checkpoint and a corrupt
adapter are dropped into the store, and a malformed entry goes into each stage stream.

See bench/chaos.py for the faults and the checks. It runs here as `make chaos` runs it, as its own
process, and the test reads the JSON report it writes. About 4-6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.slow
def test_job_survives_chaos(tiny_model, tmp_path):
    out = tmp_path / "chaos.md"
    args = ["--steps", "16", "--kills", "1", "--outage-s", "10", "--seed", "1", "--no-baseline"]
    proc = subprocess.run(
        [sys.executable, "bench/chaos.py", *args, "--model", str(tiny_model), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.with_suffix(".json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    injected = [f for f in res["faults"] if not f.get("skipped")]
    # 10 planned (5 kills, redis, store, corrupt checkpoint, corrupt adapter, malformed);
    # a fault is skipped only if the job already completed, and most must land.
    assert len(injected) >= 8, res["faults"]
    assert all(f["skipped"] == "job already complete" for f in res["faults"] if f.get("skipped")), res["faults"]
    assert all(f["survived"] for f in injected)
    checks = res["checks"]
    assert checks["job completed"], res
    assert checks["ledger balances (audit)"], res["audit_problems"]
    assert checks["nothing trained twice (trainer's checkpoints)"], res["trained_record"]
    assert checks["trainer's record == ledger trained"], (res["trained_record"], res["ledger"])
    assert checks["no corrupt checkpoint loaded"], res["resumed_from"]
    assert checks["no corrupt version adopted"], res["adopted_versions"]
    assert checks["malformed entries dead-lettered"], res["dead_letters"]
    assert checks["every service ready at the end"], res["ready"]
    # Only the restarts the faults called for: one per kill, plus the trainer's after the corrupt checkpoint.
    expected = {s: sum(f["fault"] == f"kill9:{s}" for f in injected) for s in res["restarts"]}
    expected["trainer"] += sum(f["fault"].startswith("corrupt + partial checkpoint") for f in injected)
    assert res["restarts"] == expected, (res["restarts"], injected)
