"""The inference side's share of the box in bench/burst.py: a cgroup v1 cpu quota on rollout and
reward (vLLM's engine process included), so rollout is k times slower than the trainer as in the
target deployment, and the quota that gives a target k.

k is measured, never set: rollout's rate is not linear in its quota, so `calibrate` probes it at
two quotas, fits a power law between them (`quota_for_k`), and `requota` corrects the quota
between rounds from the k a round measured."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import httpx

from bench.burst_setups import JOB, LEAVE_IDLE_S, SETUPS
from bench.burst_stats import trainer_gps
from services.cli.launch import alive
from shared.metrics import read_points
from tests.support.lab.stack import Stack, submit

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


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
    stack.launcher.stop("trainer", timeout=90)
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


def requota(quota: float, k: float, k_target: float, alpha: float, bounds: tuple[float, float] = QUOTA_BOUNDS) -> float:
    """The quota that moves a measured k to k_target, through the calibration's power law: rollout's
    rate goes as quota**alpha, so k goes as quota**-alpha. Used between rounds, because the probes run
    without a trainer beside rollout and the runs share the two cores with one (24% off on one day)."""
    if not (math.isfinite(k) and k > 0 and math.isfinite(alpha) and alpha > 0):
        return quota  # nothing measured to correct by
    return round(min(bounds[1], max(bounds[0], quota * (k / k_target) ** (1 / alpha))), 3)
