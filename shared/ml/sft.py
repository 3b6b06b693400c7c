"""SFT warm-start with TRL: teach the tiny model the task's format and a little skill.

GRPO needs a policy that is sometimes right (a group with all-zero rewards has no
signal), so `burstrl init-model` runs a short supervised pass first. The step count
is chosen to leave it at a modest accuracy: the RL run is what should raise it.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def sft_warm_start(
    model_dir: Path,
    out_dir: Path,
    *,
    task_name: str = "arith",
    # Recipe (~70 s of training on the one thread threads.one_thread builds on): long enough that the model gets
    # the sum itself right (~80-90% greedy on held-out) while only 25% of the demos stop
    # after it, so v0 is ~20% sampled / ~0% greedy and GRPO only has to drop the slip.
    steps: int = 600,
    batch_size: int = 128,
    learning_rate: float = 3e-3,
    seed: int = 0,
    correct_fraction: float = 0.25,
) -> Path:
    """Fine-tune model_dir on the task's training split; save to out_dir (safetensors)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from shared.domain.tasks import get_task

    torch.manual_seed(seed)
    task = get_task(task_name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    items = list(itertools.islice(task.train_items(seed), steps * batch_size))
    rng = random.Random(seed)
    data = Dataset.from_list(
        [
            {"prompt": it.prompt, "completion": task.demonstration(it, rng, correct_fraction) + tok.eos_token}
            for it in items
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = SFTConfig(
        output_dir=str(out_dir / "_sft_run"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=seed,
        completion_only_loss=True,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok)
    trainer.train()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def masked_sft(
    model: Any,
    tok: Any,
    out_dir: Path,
    examples: Iterator[tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    what: str,
) -> Path:
    """A plain torch SFT loop over (token ids, labels) examples, labels -100 where nothing is
    learned (a prompt, a tool's output): AdamW, warm-up over steps/20 then cosine, grad norm
    clipped at 1; batches taken from `examples` in order. Saves the model and tokenizer.

    For what TRL's completion-only loss cannot say (a tool's output masked mid-sequence), and
    for the demo models where TRL's per-step overhead dominates a model this small."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
    )
    model.train()
    for step in range(steps):
        batch = list(itertools.islice(examples, batch_size))
        width = max(len(x) for x, _ in batch)
        ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"{what} SFT step {step}/{steps} loss {loss.item():.3f}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
