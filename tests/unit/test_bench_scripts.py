"""Every bench/ script loads: its imports resolve in this tree (a harness module that moved
broke `make bench` once: bench/backlog.py still imported tests.backlog_helpers).

Run as a separate process, as `make bench` runs them; tests never import bench/ themselves."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT

# Load each script as a module (not as __main__: nothing runs), one process for all of them.
LOAD_ALL = """
import importlib.util, pathlib, sys
failed = []
for path in sorted(pathlib.Path("bench").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"bench_check.{path.stem}", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        failed.append(f"{path}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_bench_script_loads():
    proc = subprocess.run([sys.executable, "-c", LOAD_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


# One second of CPU in a child, however long that takes on a busy box.
BURN = "import time\nwhile time.process_time() < 1.0: pass"


def test_cpu_profile_counts_the_commands_processes(tmp_path):
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, "bench/cpu_profile.py", "--interval", "0.05", "--out", str(out), "--"]
    proc = subprocess.run([*cmd, sys.executable, "-c", BURN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| processes | CPU min |" in proc.stderr
    got = json.loads(out.read_text())
    burner = [p for p in got["processes"].values() if "process_time" in p["cmd"] and "cpu_profile" not in p["cmd"]]
    assert len(burner) == 1
    assert 0.5 <= burner[0]["cpu"] - burner[0]["cpu0"] <= 1.5  # at most one 0.05 s interval is missed


def test_cpu_profile_passes_on_the_commands_exit_code_and_refuses_no_command():
    cmd = [sys.executable, "bench/cpu_profile.py", "--"]
    failed = subprocess.run([*cmd, sys.executable, "-c", "raise SystemExit(3)"], cwd=ROOT, capture_output=True)
    assert failed.returncode == 3
    none = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert none.returncode == 2 and "give the command" in none.stderr


# bench/burst.py's quota_for_k, run in a child as `make bench` runs it; cases by hand below.
QUOTA_FOR_K = """
import json, math, sys
from bench.burst import quota_for_k
out = []
for case in json.loads(sys.argv[1]):
    try:
        out.append(list(quota_for_k(*case)))
    except ValueError as e:
        out.append(str(e))
print(json.dumps(out))
"""


def test_burst_quota_for_k_solves_the_power_law_through_two_probes():
    cases = [
        # alpha = log(4/2)/log(0.2/0.1) = 1; want 40/4 = 10 groups/s from the nearer probe (0.2, 4): 0.2 * 10/4
        [4.0, 40.0, [[0.1, 2.0], [0.2, 4.0]]],
        # alpha = log(4/1)/log 2 = 2; want 36/4 = 9 from (0.2, 4): 0.2 * (9/4) ** 0.5 = 0.3
        [4.0, 36.0, [[0.1, 1.0], [0.2, 4.0]]],
        # a flat pair (alpha 0.014) is clamped to 0.5: 0.2 * (10/2.02) ** 2 = 4.9 cores, clamped to 1.5
        [4.0, 40.0, [[0.1, 2.0], [0.2, 2.02]]],
        # the nearer probe is the first: want 1; 0.1 * (1/2) ** 1 = 0.05
        [10.0, 10.0, [[0.1, 2.0], [0.2, 4.0]]],
        [0.0, 40.0, [[0.1, 2.0], [0.2, 4.0]]],
        [4.0, float("nan"), [[0.1, 2.0], [0.2, 4.0]]],
        [4.0, 40.0, [[0.1, 2.0], [0.1, 4.0]]],
        [4.0, 40.0, [[0.1, 0.0], [0.2, 4.0]]],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", QUOTA_FOR_K, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got[0] == [0.5, 1.0]
    assert got[1] == [0.3, 2.0]
    assert got[2] == [1.5, 0.5]
    assert got[3] == [0.05, 1.0]
    assert "k_target must be a positive number" in got[4]
    assert "trainer_gps must be positive" in got[5]
    assert "different quotas" in got[6] and "different quotas" in got[7]


# bench/burst.py's per-round ratios and the quota re-solved between rounds, run in a child likewise.
ROUNDS = """
import json, math, sys
from bench.burst import requota
from bench.burst_report import round_ratios
runs, requotas = json.loads(sys.argv[1])
out = {}
for key, other in (("m2po_limit", "windowed"), ("m2po_limit", "trl")):
    out[f"{key}/{other}"] = [[None if math.isinf(v) else round(v, 6), exact] for v, exact in round_ratios(runs, key, other)]
out["requota"] = [requota(*case) for case in requotas]
print(json.dumps(out))
"""


def test_burst_ratios_pair_runs_of_one_round_and_the_quota_moves_k_to_its_target():
    def run(setup, rnd, to, billable=70.0):
        return {"setup": setup, "round": rnd, "to_threshold": to, "billable_s": billable}

    runs = [
        run("windowed", 0, 20.0),
        run("m2po_limit", 0, 10.0),
        run("trl", 0, 40.0),
        # round 1 reversed, and the windowed run never reached the threshold in its 80 billable s
        run("m2po_limit", 1, 20.0),
        run("windowed", 1, None, 80.0),
        run("trl", 1, 10.0),
        run("windowed", 2, 30.0),
        run("m2po_limit", 2, None),  # round 2: the backlog never reached it; no TRL
    ]
    requotas = [
        [0.2, 5.0, 4.0, 1.0],  # k 25% high: 25% more quota
        [0.2, 2.0, 4.0, 2.0],  # k half the target at alpha 2: 0.2 * 0.5 ** 0.5
        [0.2, float("nan"), 4.0, 1.0],  # no k measured: unchanged
        [1.2, 8.0, 4.0, 1.0],  # 2.4 cores, clamped to 1.5
    ]
    proc = subprocess.run(
        [sys.executable, "-c", ROUNDS, json.dumps([runs, requotas])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["m2po_limit/windowed"] == [[0.5, True], [0.25, False], [None, True]]
    assert got["m2po_limit/trl"] == [[0.25, True], [2.0, True]]
    assert got["requota"] == [0.25, 0.141, 0.2, 1.5]


# bench/burst.py's refine: the versions evaluated again where the grid skipped the threshold's crossing.
REFINE = """
import json, sys
from bench.burst import refine
print(json.dumps([refine(*case) for case in json.loads(sys.argv[1])]))
"""


def test_burst_refine_evaluates_the_versions_the_grid_skipped_before_the_threshold():
    def ev(*pairs):
        return [{"version": v, "accuracy": acc} for v, acc in pairs]

    versions = list(range(1, 51))
    cases = [
        # the 2026-12-04 run: 0.484 at v25, next evaluated v46 at 0.754: 26..45 (20) at a stride of 3
        [versions, ev((0, 0.26), (24, 0.453), (25, 0.484), (46, 0.754), (50, 0.88)), 0.5],
        # the crossing between adjacent evaluated versions: nothing to add
        [versions, ev((0, 0.26), (24, 0.49), (25, 0.51), (46, 0.754)), 0.5],
        # never reached: nothing to refine
        [versions, ev((0, 0.26), (25, 0.484), (50, 0.49)), 0.5],
        # reached at the first evaluation after the base: v1..v3 between v0 and v4, all of them
        [versions, ev((0, 0.26), (4, 0.6)), 0.5],
        # a dip after the crossing does not move it: the first at or above the threshold counts
        [versions, ev((0, 0.26), (10, 0.52), (12, 0.45), (30, 0.7)), 0.5, 2],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", REFINE, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got[0] == [26, 29, 32, 35, 38, 41, 44]
    assert got[1] == [] and got[2] == []
    assert got[3] == [1, 2, 3]
    assert got[4] == [1, 6]  # v1..v9 at a stride of 5 (most 2)


# bench/burst_report.py's reading of a burst-side replica: each replica setup against its pair.
REPLICA = """
import json, sys
from bench.burst_report import pair_lines
runs, many = json.loads(sys.argv[1])
print(json.dumps(pair_lines(runs, {x["setup"] for x in runs}, 0.5, many)))
"""


def _run(setup: str, rnd: int, to: float | None, billable: float, evals: list[tuple[float, float]]) -> dict:
    """One run's record as bench/burst.py writes it, with only the fields pair_lines reads."""
    return {
        "setup": setup,
        "round": rnd,
        "to_threshold": to,
        "billable_s": billable,
        "evals": [{"t": t, "accuracy": acc} for t, acc in evals],
    }


def _pair_line(runs: list[dict]) -> str:
    """pair_lines' one line for these runs, read in a fresh interpreter as the page builder does."""
    proc = subprocess.run(
        [sys.executable, "-c", REPLICA, json.dumps([runs, True])], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = json.loads(proc.stdout.strip().splitlines()[-1])
    return line


def test_burst_replica_reading_pairs_each_replica_setup_with_the_same_job_without_one():
    runs = [
        # round 0: the replica reaches 0.5 in 12 s against 24 s; at its 70 billable s 0.8 vs 0.6
        _run("m2po_limit", 0, 24.0, 72.0, [(0, 0.2), (24, 0.5), (60, 0.6), (71, 0.7)]),
        _run("replica_limit", 0, 12.0, 70.0, [(0, 0.2), (12, 0.55), (69, 0.8)]),
        # round 1: the replica never reaches it
        _run("replica_limit", 1, None, 70.0, [(0, 0.2), (50, 0.4)]),
        _run("m2po_limit", 1, 30.0, 71.0, [(0, 0.2), (30, 0.52)]),
        # a replica run without its pair (m2po) is not read
        _run("replica", 0, 10.0, 70.0, [(0, 0.2)]),
    ]
    line = _pair_line(runs)
    assert line.startswith(
        "- backlog + M2PO, staleness limit 16 + burst-side replica / backlog + M2PO, staleness limit 16"
    )
    assert "**per round 0.50x, never; median inf**" in line
    assert line.endswith("0.800 vs 0.600 at 70 s; 0.400 vs 0.520 at 70 s")


def test_burst_pair_reading_reads_dynamic_sampling_against_the_same_job_without_it():
    runs = [
        _run("m2po_limit", 0, 12.0, 72.0, [(0, 0.2), (12, 0.5), (72, 0.8)]),
        _run("m2po_limit_ds", 0, 9.0, 71.0, [(0, 0.2), (9, 0.5), (70, 0.9)]),
        _run("m2po_limit_ds", 1, 15.0, 70.0, [(0, 0.2), (15, 0.5), (69, 0.7)]),
        _run("m2po_limit", 1, 10.0, 71.0, [(0, 0.2), (10, 0.5), (70, 0.75)]),
    ]
    line = _pair_line(runs)
    assert line.startswith(
        "- backlog + M2PO, staleness limit 16, dynamic sampling / backlog + M2PO, staleness limit 16, billable s"
    )
    # 9 / 12 and 15 / 10; their median is the mean of the two. At 71 s the pair had read 0.5 (its v at 12 s).
    assert "**per round 0.75x, 1.50x; median 1.12x**" in line
    assert "(no target: below 1x skipping the groups with no advantage pays)" in line
    assert line.endswith("accuracy at its run's billable s: 0.900 vs 0.500 at 71 s; 0.700 vs 0.750 at 70 s")
