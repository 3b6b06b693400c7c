"""The one held-out evaluator of every comparison, and the workloads it evaluates.

Both sides of a comparison (burstrl's published versions, TRL's policy after each step) are
scored by `heldout_accuracy`: EVAL_N held-out prompts x EVAL_K samples at T=1 with HF `generate`,
seeded per policy version, so two sides' version-v evaluations draw the same random numbers.
burstrl's versions are fetched from the object store afterwards (hashes verified) and evaluated
off every clock (`evaluate_versions`)."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from tests.support import ROOT

MODELS = ROOT / ".burstrl" / "models"
EVAL_N, EVAL_K = 64, 4


class Workload(NamedTuple):
    """A task of the comparison: its SFT'd tiny model, max new tokens, default learning rate
    (--lr overrides it, for both sides)."""

    model: Path
    max_tokens: int
    lr: float


# "arith" answers in a few tokens, so a step is mostly the optimizer's; "countup" writes up to
# ~90 (shared/domain/tasks/countup.py), so generation is a large share of a step, as with real models
# and long reasoning.
WORKLOADS = {
    "arith": Workload(MODELS / "tiny-sft", 6, 1e-3),
    "countup": Workload(MODELS / "tiny-countup", 96, 5e-4),
}


def ensure_model(task: str) -> Path:
    """The workload's model, built offline on first use."""
    from shared.ml.models import ensure_model

    path = WORKLOADS[task].model
    return ensure_model(path.name, path)


def heldout_accuracy(model: Any, tok: Any, version: int, task_name: str) -> float:
    """The one evaluator of both sides: EVAL_N held-out prompts x EVAL_K samples at T=1.

    Seeded per policy version inside a forked RNG, so the two sides' version-v evaluations
    draw the same random numbers and TRL's training RNG is left as it was.
    """
    import torch

    from shared.domain.tasks import get_task

    task = get_task(task_name)
    held = task.heldout_items(EVAL_N)
    was_training = model.training
    model.eval()
    enc = tok([it.prompt for it in held], return_tensors="pt", padding=True)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(10_000 + version)
        gen = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=WORKLOADS[task_name].max_tokens,
            num_return_sequences=EVAL_K,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    right = [task.score(t, held[i // EVAL_K].fields)["correct"] for i, t in enumerate(texts)]
    model.train(was_training)
    return sum(right) / len(right)


def evaluate_versions(
    model: str, task: str, store_url: str, job_id: str, times: dict[int, float]
) -> list[dict[str, Any]]:
    """burstrl's published versions, fetched (hashes verified) and evaluated by `heldout_accuracy`.

    `times` maps version -> seconds from submission to the end of the step that made it.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.policy import fetch_version
    from shared.store import open_store

    torch.set_num_threads(os.cpu_count() or 2)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    store = open_store(store_url)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    evals = [{"version": 0, "t": 0.0, "accuracy": heldout_accuracy(base, tok, 0, task)}]
    with tempfile.TemporaryDirectory(prefix="burstrl-trl-eval-") as tmp:
        for v in sorted(times):
            dest = Path(tmp) / f"v{v}"  # a fresh folder per version, as rollout does
            fetch_version(store, job_id, v, dest)
            policy = PeftModel.from_pretrained(copy.deepcopy(base), str(dest))
            evals.append({"version": v, "t": round(times[v], 2), "accuracy": heldout_accuracy(policy, tok, v, task)})
    return evals
