"""The benchmarks' own code: every bench/ script loads, their pure functions, the collected index.

The one test module that imports bench/ (docs/architecture.md, "Tests in layers"): a benchmark's
pure functions are tested where they live, in-process; what a benchmark shares with others lives in
tests/support/lab/ and is tested through them. Scripts that are commands (cpu_profile) run as their
own process, as their users run them."""

from __future__ import annotations

import importlib
import json
import math
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.lab.results import RESULTS, figure, shown_command, write_json

SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_bench_script_loads(name):
    """Its imports resolve in this tree (a harness module that moved broke `make bench` once)."""
    importlib.import_module(f"bench.{name}")


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


# -- bench/burst.py's quota, ratios and evaluation grid ---------------------------------------------
def test_burst_quota_for_k_solves_the_power_law_through_two_probes():
    from bench.burst_quota import quota_for_k

    # alpha = log(4/2)/log(0.2/0.1) = 1; want 40/4 = 10 groups/s from the nearer probe (0.2, 4): 0.2 * 10/4
    assert quota_for_k(4.0, 40.0, [(0.1, 2.0), (0.2, 4.0)]) == (0.5, 1.0)
    # alpha = log(4/1)/log 2 = 2; want 36/4 = 9 from (0.2, 4): 0.2 * (9/4) ** 0.5 = 0.3
    assert quota_for_k(4.0, 36.0, [(0.1, 1.0), (0.2, 4.0)]) == (0.3, 2.0)
    # a flat pair (alpha 0.014) is clamped to 0.5: 0.2 * (10/2.02) ** 2 = 4.9 cores, clamped to 1.5
    assert quota_for_k(4.0, 40.0, [(0.1, 2.0), (0.2, 2.02)]) == (1.5, 0.5)
    # the nearer probe is the first: want 1; 0.1 * (1/2) ** 1 = 0.05
    assert quota_for_k(10.0, 10.0, [(0.1, 2.0), (0.2, 4.0)]) == (0.05, 1.0)
    with pytest.raises(ValueError, match="k_target must be a positive number"):
        quota_for_k(0.0, 40.0, [(0.1, 2.0), (0.2, 4.0)])
    with pytest.raises(ValueError, match="trainer_gps must be positive"):
        quota_for_k(4.0, float("nan"), [(0.1, 2.0), (0.2, 4.0)])
    for probes in ([(0.1, 2.0), (0.1, 4.0)], [(0.1, 0.0), (0.2, 4.0)]):
        with pytest.raises(ValueError, match="different quotas"):
            quota_for_k(4.0, 40.0, probes)


def test_burst_ratios_pair_runs_of_one_round_and_the_quota_moves_k_to_its_target():
    from bench.burst_quota import requota
    from bench.burst_stats import round_ratios

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
    assert round_ratios(runs, "m2po_limit", "windowed") == [(0.5, True), (0.25, False), (math.inf, True)]
    assert round_ratios(runs, "m2po_limit", "trl") == [(0.25, True), (2.0, True)]
    assert requota(0.2, 5.0, 4.0, 1.0) == 0.25  # k 25% high: 25% more quota
    assert requota(0.2, 2.0, 4.0, 2.0) == 0.141  # k half the target at alpha 2: 0.2 * 0.5 ** 0.5
    assert requota(0.2, float("nan"), 4.0, 1.0) == 0.2  # no k measured: unchanged
    assert requota(1.2, 8.0, 4.0, 1.0) == 1.5  # 2.4 cores, clamped to 1.5


def test_burst_refine_evaluates_the_versions_the_grid_skipped_before_the_threshold():
    from bench.burst_eval import refine

    def ev(*pairs):
        return [{"version": v, "accuracy": acc} for v, acc in pairs]

    versions = list(range(1, 51))
    # the 2026-12-04 run: 0.484 at v25, next evaluated v46 at 0.754: 26..45 (20) at a stride of 3
    grid = ev((0, 0.26), (24, 0.453), (25, 0.484), (46, 0.754), (50, 0.88))
    assert refine(versions, grid, 0.5) == [26, 29, 32, 35, 38, 41, 44]
    # the crossing between adjacent evaluated versions: nothing to add
    assert refine(versions, ev((0, 0.26), (24, 0.49), (25, 0.51), (46, 0.754)), 0.5) == []
    # never reached: nothing to refine
    assert refine(versions, ev((0, 0.26), (25, 0.484), (50, 0.49)), 0.5) == []
    # reached at the first evaluation after the base: v1..v3 between v0 and v4, all of them
    assert refine(versions, ev((0, 0.26), (4, 0.6)), 0.5) == [1, 2, 3]
    # a dip after the crossing does not move it: the first at or above the threshold counts;
    # v1..v9 at a stride of 5 (most 2)
    assert refine(versions, ev((0, 0.26), (10, 0.52), (12, 0.45), (30, 0.7)), 0.5, 2) == [1, 6]


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
    from bench.burst_report import pair_lines

    (line,) = pair_lines(runs, {x["setup"] for x in runs}, 0.5, True)
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


# -- bench/burst.py's page, rebuilt from its JSON ---------------------------------------------------
def test_burst_command_shown_on_the_page_runs_as_shown():
    """An empty argument stays one (a run with `--lags ''` once showed `--lags  --rounds 3`, which
    argparse refuses), so the shown command both reruns and rebuilds the page."""
    from bench.burst import parser, settings

    argv = ["--setups", "windowed,m2po_limit", "--lags", "", "--rounds", "3", "--cycle-s", "300"]
    shown = shown_command(str(ROOT / "bench" / "burst.py"), argv)
    assert shown.startswith(".venv/bin/python bench/burst.py ")
    again = settings(parser(), shlex.split(shown)[2:])
    assert (again.lags, again.rounds, again.cycle_s, again.setup_list) == ("", 3, 300.0, ["windowed", "m2po_limit"])


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob("burst*.json")))
def test_burst_page_rebuilds_from_its_json_with_the_runs_own_settings(name, tmp_path, capsys):
    """--report-only with nothing but --out: the page that run made, byte for byte but for the plot's
    path (here in tmp_path). The settings come from the command in the JSON: a 300 s-cycle run's page
    rebuilt with this command line's defaults would say 140 s cycles."""
    from bench.burst import rebuild

    shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    rebuild(tmp_path / f"{name}.md")
    capsys.readouterr()  # the page is printed too

    def page(path):
        return [ln for ln in path.read_text().splitlines() if not ln.startswith("Plot: ")]

    assert page(tmp_path / f"{name}.md") == page(RESULTS / f"{name}.md")
    assert (tmp_path / f"{name}.png").exists()
    assert json.loads((tmp_path / f"{name}.json").read_text())["headline"]


# -- the index bench/run_all.py collects ------------------------------------------------------------
def _results(tmp_path, name, figures, command):
    page = tmp_path / f"{name}.md"
    page.write_text(f"## {name}\n")
    write_json(page, {"runs": []}, figures, command)


def test_run_all_collects_every_headline_row_from_the_results_json(tmp_path):
    from bench.run_all import index

    _results(tmp_path, "zeta", [figure("z figure", "3 s", baseline="6 s", ratio=0.5, target="<= 0.5x")], "cmd z")
    _results(tmp_path, "bus", [figure("bus / raw", "0.9", ratio=float("inf"))], "cmd bus")
    _results(tmp_path, "empty", [], "cmd empty")  # no figures: not a row, not a page
    (tmp_path / "zeta.png").write_bytes(b"png")
    text = index(tmp_path, ["pipeline", "bus"], "collected for a test", [])
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "](" in ln]
    # the named benchmarks first, in their order, then the rest by name
    assert rows[0] == "| bus / raw | 0.9 |  |  |  | [bus](bus.md) |"  # an infinite ratio is no ratio
    assert rows[1] == "| z figure | 3 s | 6 s | **0.50x** | <= 0.5x | [zeta](zeta.md) |"
    assert rows[2].startswith("| [bus](bus.md) | `cmd bus` | 20")
    assert rows[3].startswith("| [zeta](zeta.md) | `cmd z` | 20") and rows[3].endswith("| [zeta.png](zeta.png) |")
    assert len(rows) == 4 and "empty" not in text and "## Run log" not in text


def test_run_all_refuses_a_headline_row_naming_the_file_row_and_field(tmp_path):
    from bench.run_all import index

    _results(tmp_path, "bus", [figure("ok", "1")], "cmd")
    data = json.loads((tmp_path / "bus.json").read_text())
    data["headline"].append({**data["headline"][0], "ratio": "fast"})
    del data["headline"][1]["page"]
    (tmp_path / "bus.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit) as e:
        index(tmp_path, ["bus"], "", [])
    assert "bus.json: bad headline" in str(e.value)
    assert "row 1, field ratio" in str(e.value) and "row 1, field page: Field required" in str(e.value)


def test_run_all_collect_only_writes_the_index_from_the_results_as_they_are(tmp_path):
    _results(tmp_path, "bus", [figure("bus / raw", "0.9", ratio=0.9)], "cmd bus")
    cmd = [sys.executable, "bench/run_all.py", "--collect-only", "--results", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "index.md").read_text()
    assert "| bus / raw | 0.9 |  | **0.90x** |  | [bus](bus.md) |" in text
    assert "Collected without running anything" in text


def test_smollm2_lag_stats_are_nothing_on_policy_and_grow_off_it():
    """bench/smollm2_lag.py: the trainer's own statistics of a batch; a lag of 0 is exactly on
    policy, and log-ratios of spread 1 (M2 ~ 1, 25x M2PO's tau) show in every column."""
    import torch

    from bench.smollm2_lag import lag_stats

    g = torch.Generator().manual_seed(0)
    behav = -3.0 * torch.rand(8, 12, generator=g)
    mask = torch.ones(8, 12)
    mask[:, 10:] = 0.0
    same = lag_stats(behav.clone(), behav, mask)
    assert same["m2"] == 0.0 and same["tis_frac"] == 0.0 and same["m2po_frac"] == 0.0
    assert same["ess_raw"] == pytest.approx(1.0)
    far = lag_stats(behav + torch.randn(8, 12, generator=g), behav, mask)
    assert far["m2"] > 0.5 and far["m2po_frac"] > 0.5 and far["tis_frac"] > 0.05 and far["ess_raw"] < 0.9


def test_smollm2_lag_max_lag_stops_at_the_first_lag_that_masks_too_much():
    from bench.smollm2_lag import MASK_LIMIT, max_lag

    rows = [
        {"lag": 1, "m2po_frac": 0.0},
        {"lag": 1, "m2po_frac": 0.01},
        {"lag": 4, "m2po_frac": MASK_LIMIT},  # at the limit still passes
        {"lag": 8, "m2po_frac": 0.2},
        {"lag": 16, "m2po_frac": 0.0},  # beyond a failure: not taken
    ]
    assert max_lag(rows) == 4
    assert max_lag([{"lag": 1, "m2po_frac": 0.5}]) == 0
