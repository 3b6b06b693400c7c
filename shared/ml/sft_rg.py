"""The reasoning-gym demo's warm start: a short SFT of the tiny model on reasoning-gym's own items.

The tiny model (tiny-sft) was SFT'd on burstrl's "a+b=" data and scores ~0 on reasoning-gym's
prompts, so GRPO groups there carry no signal (README, "Tasks from reasoning-gym"). As for the
arith demo, GRPO needs a policy that is sometimes right: this SFT trains the random-init tiny
architecture on the demo task's generator output, prompts rendered exactly as the job renders
them (examples/demo_rg.toml), and stops short, at partial competence, for RL to improve.

Only the task's train split is used: items come from `train_items`, which skips every question
whose hash puts it in the held-out split (shared/domain/tasks/rg.py), so the held-out items the
job evaluates on are never trained on (tests/integration/test_sft_rg.py checks).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The demo task (examples/demo_rg.toml must say the same: tests/integration/test_sft_rg.py checks).
# chain_sum of 2-3 single-digit terms with + and -: "5 + 8 - 9 =" -> "4". reasoning-gym's own
# question ends in the expression and " ="; the template keeps just that tail because the tiny
# model's context is 256 byte tokens and each prompt byte costs CPU time in SFT and rollout.
RG_TASK = "rg:chain_sum"
RG_ARGS: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1, "answer_format": "raw"}
RG_TEMPLATE = "{expression} ="
# A stream of its own: any seed gives train items only (the split is by question hash, not
# seed), but this one is not a job's default seed, so GRPO does not replay the SFT's order.
RG_SFT_SEED = 7


def rg_sft_examples(n: int, *, seed: int = RG_SFT_SEED) -> Iterator[tuple[str, str, str]]:
    """(item_id, prompt, completion) for n train items of the demo task, as the job prompts them."""
    from shared.domain.tasks import make_task
    from shared.domain.tasks.base import ConfiguredTask

    task = ConfiguredTask(make_task(RG_TASK, RG_ARGS), RG_TEMPLATE, [])
    for item in itertools.islice(task.train_items(seed), n):
        yield item.item_id, item.prompt, item.fields["answer"]


def sft_rg(
    model_dir: Path,
    out_dir: Path,
    *,
    # 19,200 items, 85-100 s on a busy 2-core box: held-out pass@1 ~0.15 at T=1, greedy ~0.2.
    # (batch_size=256 reaches ~0.35 / ~0.6 but takes ~4x as long; GRPO improved neither.)
    steps: int = 300,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    seed: int = RG_SFT_SEED,
) -> Path:
    """Fine-tune model_dir on the demo task's train items (loss on the answer and EOS only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.ml.sft import masked_sft

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = rg_sft_examples(steps * batch_size, seed=seed)

    def encode(prompt: str, completion: str) -> tuple[list[int], list[int]]:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(completion + tok.eos_token, add_special_tokens=False)["input_ids"]
        return p + c, [-100] * len(p) + c

    encoded = (encode(p, c) for _, p, c in examples)
    return masked_sft(
        model, tok, out_dir, encoded, steps=steps, batch_size=batch_size, learning_rate=learning_rate, what=RG_TASK
    )
