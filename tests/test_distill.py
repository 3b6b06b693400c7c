"""On-policy distillation through the real services, as separate processes.

The student is the tiny SFT model (it adds a slip digit after most sums: ~16% sampled
accuracy); the teacher is the same model SFT'd longer on clean demonstrations (~90%),
built once and cached under .burstrl/models/. The ref service serves the teacher
(BURSTRL_REF_MODEL), rollout and trainer the student. The job has `teacher` set and
`algorithm.advantage = "distill"`: each token's advantage is log p_teacher - log p_student
on the student's own samples, with no reward in it. The student-teacher KL must fall over
the versions and the held-out accuracy must rise.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from shared.ml.models import ensure_teacher_model
from tests.conftest import ROOT, service_stack, wait_for

ROLES = ["api", "reward", "ref", "rollout", "trainer"]
STEPS = 14
JOB = {
    "name": "distill",
    "task": "arith",
    "group_size": 8,
    "batch_size": 8,
    "steps": STEPS,
    "learning_rate": 2e-3,
    "max_staleness": 1,
    "eval_size": 64,
    "algorithm": {"advantage": "distill"},
    "sampling": {"temperature": 1.0, "max_tokens": 6},
}


@pytest.fixture(scope="session")
def teacher_model(tiny_model: Path) -> Path:
    return ensure_teacher_model(ROOT / ".burstrl" / "models" / "tiny-teacher", tiny_model)


@pytest.mark.slow
def test_distillation_lowers_kl_and_raises_accuracy(tmp_path: Path, tiny_model: Path, teacher_model: Path) -> None:
    with service_stack(
        tmp_path,
        tiny_model,
        ROLES,
        env_extra={"BURSTRL_DEV": "1"},
        role_env={"ref": {"BURSTRL_REF_MODEL": str(teacher_model)}},  # the ref serves the teacher
        store_url=f"file://{tmp_path / 'store'}",
    ) as stack:
        t0 = stack.started_at
        t_ready = time.time() - t0
        api = stack.api
        body = {**JOB, "base_model": str(tiny_model), "teacher": str(teacher_model)}
        resp = httpx.post(f"{api}/v1/jobs", json=body, timeout=10)
        assert resp.status_code in (200, 201), resp.text
        job_id = resp.json()["id"]

        def done() -> dict | None:
            s = httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()
            finished = s["job"]["state"] == "completed" and s["evals"] and s["evals"][-1]["version"] == STEPS
            return s if finished else None

        final = wait_for(done, 600, "job completion and final eval", stack.launcher)
        points = {
            src: httpx.get(f"{api}/v1/jobs/{job_id}/metrics", params={"source": src}, timeout=10).json()
            for src in ("trainer", "ref")
        }
    elapsed = time.time() - t0

    trainer, ref = points["trainer"], points["ref"]
    assert [p["step"] for p in trainer] == list(range(1, STEPS + 1))
    assert final["ledger"]["trained"] == STEPS * JOB["batch_size"]
    assert final["ledger"].get("dead", 0) == 0
    # Student-teacher KL on the student's samples: the trainer's (k3, at train time) by step,
    # and the ref's (k1, sampler vs teacher) by the version that sampled.
    kl = [p["kl_ref"] for p in trainer]
    by_version: dict[int, list[float]] = {}
    for p in ref:
        if p["policy_version_min"] == p["policy_version_max"] and p["kl_sampler_ref"] is not None:
            by_version.setdefault(p["policy_version_min"], []).append(p["kl_sampler_ref"])
    ref_kl = {v: sum(xs) / len(xs) for v, xs in sorted(by_version.items())}
    evals = final["evals"]
    acc = [(e["version"], round(e["accuracy"], 3), round(e.get("greedy_accuracy", 0.0), 3)) for e in evals]
    print(f"\nready after {t_ready:.0f}s, total {elapsed:.0f}s")
    print("trainer kl_ref (k3) by step:", [round(x, 3) for x in kl])
    print("ref kl_sampler_ref (k1) by sampling version:", {v: round(x, 3) for v, x in ref_kl.items()})
    print("held-out (version, pass@1, greedy):", acc)
    print("train reward by step:", [round(p["reward_mean"], 3) for p in trainer])
    assert all(p["tokens_per_s"] > 0 and p["queue_lag_s"] is not None for p in ref)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    # KL is noisy per batch (it is mostly the rate of the student's slip digit, ~10 nats each).
    assert mean(kl[-3:]) < 0.6 * mean(kl[:3]), kl
    versions = sorted(ref_kl)
    assert versions[0] == 0, ref_kl
    early = [x for v, x in ref_kl.items() if v <= 2]
    late = [ref_kl[v] for v in versions[-3:]]
    assert mean(late) < 0.6 * mean(early), ref_kl
    assert evals[0]["version"] == 0
    assert evals[-1]["accuracy"] > evals[0]["accuracy"] + 0.15, acc
    assert evals[-1]["greedy_accuracy"] > evals[0]["greedy_accuracy"] + 0.3, acc
