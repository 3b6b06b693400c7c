"""The trainer's step with and without length-sorted micro-batches, side by side.

One GRPO batch of real completions (8 prompts x G=16 sampled at T=1 from the task's tiny
model with HF generate, so lengths are as uneven as in a job), then `Learner.train_batch`
on it with `micro_batch_tokens` 0 (one pass padded to the longest row, the trainer before
this setting) and the default, alternating, each from the same fresh LoRA policy. Reports
the median seconds per step and the ratio; the update is the same either way
(tests/unit/test_trainer_modes.py checks that).

    .venv/bin/python bench/trainer_passes.py [--task countup] [--rounds 5] [--budgets 0,4096] [--out bench/results/trainer_passes.md]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.lab.heldout import WORKLOADS, ensure_model  # noqa: E402
from tests.support.lab.jobs import BATCH, G  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402


def sample_batch(model_dir: str, task_name: str, max_tokens: int) -> list:  # noqa: ANN001
    """8 groups of G completions, sampled from the model, as the trainer receives them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.domain.tasks import get_task
    from shared.schema import Completion, GroupMsg, pack_f32, pack_i32, pack_u8

    torch.manual_seed(0)
    task = get_task(task_name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    groups = []
    for i, it in enumerate(itertools.islice(task.train_items(0), BATCH)):
        ids = tok(it.prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=True,
                max_new_tokens=max_tokens,
                num_return_sequences=G,
                pad_token_id=tok.pad_token_id,
            )
        comps = []
        for row in out[:, len(ids) :].tolist():
            n = next((k + 1 for k, t in enumerate(row) if t == tok.eos_token_id), len(row))
            text = tok.decode(row[:n], skip_special_tokens=True)
            comps.append(
                Completion(
                    token_ids=pack_i32(row[:n]),
                    logprobs=pack_f32([-1.0] * n),
                    ref_logprobs=pack_f32([-1.0] * n),
                    loss_mask=pack_u8([1] * n),
                    text=text,
                    finish_reason="stop",
                    reward=task.score(text, it.fields)["correct"],
                )
            )
        groups.append(
            GroupMsg(
                job_id="bench",
                group_id=f"g{i}",
                item_id=it.item_id,
                prompt=it.prompt,
                prompt_ids=pack_i32(ids),
                policy_version=0,
                completions=comps,
                stage="ready",
            )
        )
    return groups


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: each micro_batch_tokens setting's step against
    the first setting's (one padded pass), medians."""
    med = {int(b): statistics.median(ts) for b, ts in res["times"].items()}
    first, *rest = res["budgets"]
    against = "one padded pass" if first == 0 else f"micro_batch_tokens {first}"
    task, base = res["task"], f"{med[first]:.3f} s/step"
    return [
        figure(
            f"trainer step, micro_batch_tokens {b} vs {against} ({task}), speed",
            f"{med[b]:.3f} s/step",
            base,
            med[first] / med[b],
        )
        for b in rest
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(WORKLOADS), default="countup")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budgets", default="0,4096", help="micro_batch_tokens settings, comma-separated.")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the local stack gives the trainer 1).")
    ap.add_argument("--out", type=Path, help="Also write the markdown here (and .json beside it).")
    a = ap.parse_args()
    import torch

    from services.trainer.learner import Learner
    from services.trainer.policy import load_policy
    from shared.job import JobSpec
    from shared.schema import unpack_f32

    torch.set_num_threads(a.threads)
    budgets = [int(x) for x in a.budgets.split(",")]
    model_dir = str(ensure_model(a.task))
    groups = sample_batch(model_dir, a.task, WORKLOADS[a.task].max_tokens)
    lengths = [len(unpack_f32(c.logprobs)) for g in groups for c in g.completions]
    spec = JobSpec(
        base_model=model_dir, task=a.task, group_size=G, batch_size=BATCH, steps=10, kl_coef=0.001, lora_rank=16
    )
    times: dict[int, list[float]] = {b: [] for b in budgets}
    for rnd in range(a.rounds + 1):  # round 0 warms up and is not counted
        for b in budgets if rnd % 2 == 0 else budgets[::-1]:
            model, tok = load_policy(model_dir, rank=16, alpha=32, device="cpu", seed=0)
            learner = Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0, micro_batch_tokens=b)
            t = time.perf_counter()
            learner.train_batch(groups)
            if rnd:
                times[b].append(time.perf_counter() - t)
    cmd = shown_command(__file__)
    lines = [
        "## Trainer step: one padded pass vs length-sorted micro-batches",
        "",
        f"`{cmd}`",
        "",
        f"One batch of {len(lengths)} completions sampled from the {a.task} model: {statistics.mean(lengths):.1f} "
        f"tokens on average, {max(lengths)} the longest; {a.threads} torch thread(s), {a.rounds} alternating rounds.",
        "",
        "| micro_batch_tokens | s / step (median) | speed vs one pass |",
        "|---|---|---|",
    ]
    base = statistics.median(times[budgets[0]])
    for b in budgets:
        m = statistics.median(times[b])
        lines.append(f"| {b or '0 (one pass)'} | {m:.3f} | **{base / m:.2f}x** |")
    data = {"task": a.task, "threads": a.threads, "budgets": budgets, "lengths": lengths, "times": times}
    emit("\n".join(lines) + "\n", a.out, data, figures=figures(data), command=cmd)


if __name__ == "__main__":
    main()
