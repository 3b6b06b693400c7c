"""On-policy distillation through the real services, as separate processes.

The student is the tiny SFT model (it adds a slip digit after most sums: ~16% sampled
accuracy); the teacher is the same model SFT'd longer on clean demonstrations (~90%),
built once and cached under .burstrl/models/. The ref service serves the teacher
(BURSTRL_REF_MODEL), rollout and trainer the student. The job has `teacher` set and
`algorithm.advantage = "distill"`: each token's advantage is log p_teacher - log p_student
on the student's own samples, with no reward in it. The student-teacher KL must fall over
the versions and the held-out accuracy must rise (both measured offline on the whole
held-out set, see below).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.support.jobs import arith_job
from tests.support.stack import service_stack, wait_for

ROLES = ["api", "reward", "ref", "rollout", "trainer"]
# lr 5e-4 over 28 steps, not 2e-3 over 14: the distillation advantage is an unnormalised log-ratio
# (a slip token the teacher never emits scores about -15), so 2e-3 took a step ~10x a GRPO step's
# size and diverged on some builds of the tiny model (the batch KL to the teacher jumped to 33
# nats at step 3 and the held-out KL rose 7.50 -> 11.49; another build: 8.22 -> 7.53). Measured on
# three builds (SFT seeds 0, 1, 2): held-out KL 0.64x, 0.30x, 0.34x of v0, greedy accuracy +0.51,
# +0.81, +0.90, against the bounds below of 0.75x and +0.2.
STEPS = 28
JOB = arith_job(
    "distill",
    group=8,
    batch=8,
    steps=STEPS,
    learning_rate=5e-4,
    eval_size=0,  # judged offline below, on the whole held-out set
    algorithm={"advantage": "distill"},
)


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
            return s if s["job"]["state"] == "completed" else None

        final = wait_for(done, 600, "job completion", stack.launcher)
        points = {
            src: httpx.get(f"{api}/v1/jobs/{job_id}/metrics", params={"source": src}, timeout=10).json()
            for src in ("trainer", "ref")
        }
    elapsed = time.time() - t0

    trainer, ref = points["trainer"], points["ref"]
    assert [p["step"] for p in trainer] == list(range(1, STEPS + 1))
    assert final["ledger"]["trained"] == STEPS * JOB["batch_size"]
    assert final["ledger"].get("dead", 0) == 0
    assert all(p["tokens_per_s"] > 0 and p["queue_lag_s"] is not None for p in ref)
    print(f"\nready after {t_ready:.0f}s, total {elapsed:.0f}s")
    print("trainer kl_ref (k3) by step:", [round(p["kl_ref"], 3) for p in trainer])

    # Judged offline on the whole held-out set, not on the job's noisy per-batch numbers (a
    # batch's KL ranged 1.1-3.1 nats in one run: mostly whether the student's slip digit was
    # sampled). Exact KL(student || teacher) over the vocabulary at every position of the
    # teacher's greedy answers, and greedy accuracy, for v0 (the student as built) and the last
    # version: deterministic given the weights, so only training noise is left.
    before = held_out_measures(tiny_model, None, teacher_model)
    after = held_out_measures(tiny_model, fetch_adapter(tmp_path, job_id, STEPS), teacher_model)
    print(f"held-out: v0 {before}, v{STEPS} {after}")
    # The student starts ~0.0 greedy (its slip is its mode); 28 steps moved it to 0.51-0.90 on the
    # three builds measured (see STEPS), and the KL to 0.30-0.64x of v0.
    assert after["kl"] < 0.75 * before["kl"], (before, after)
    assert after["greedy_accuracy"] > before["greedy_accuracy"] + 0.2, (before, after)


def fetch_adapter(tmp_path: Path, job_id: str, version: int) -> Path:
    from shared.policy import fetch_version
    from shared.store import FileStore

    dest = tmp_path / f"v{version}"
    fetch_version(FileStore(tmp_path / "store"), job_id, version, dest)  # hashes and fence checked
    return dest


def held_out_measures(student: Path, adapter: Path | None, teacher: Path) -> dict[str, float]:
    """Mean exact KL(student || teacher) summed over the teacher's greedy answer tokens, and the
    student's greedy accuracy, over every held-out arith prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.domain.tasks.arith import ArithTask

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(student)
    s_model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        s_model = PeftModel.from_pretrained(s_model, str(adapter)).eval()
    t_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    task = ArithTask()
    items = task.heldout_items(10_000)
    kls, correct = [], 0
    with torch.no_grad():
        for it in items:
            ids = torch.tensor([tok(it.prompt)["input_ids"]])
            gen = dict(max_new_tokens=JOB["sampling"]["max_tokens"], do_sample=False, pad_token_id=tok.pad_token_id)
            t_out = t_model.generate(ids, **gen)
            s_out = s_model.generate(ids, **gen)
            correct += task.score(tok.decode(s_out[0, ids.shape[1] :], skip_special_tokens=True), it.fields)["correct"]
            n = t_out.shape[1] - ids.shape[1]
            ls = torch.log_softmax(s_model(t_out).logits[0, ids.shape[1] - 1 : -1].float(), -1)  # [n, V]
            lt = torch.log_softmax(t_model(t_out).logits[0, ids.shape[1] - 1 : -1].float(), -1)
            assert ls.shape[0] == n
            kls.append(float((ls.exp() * (ls - lt)).sum()))
    return {"kl": round(sum(kls) / len(kls), 4), "greedy_accuracy": round(correct / len(items), 4)}
