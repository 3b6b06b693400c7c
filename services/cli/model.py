"""Build the tiny model once (idempotent): random Qwen2 + byte tokenizer, then SFT."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

DONE = "burstrl_ready.json"
# Bump when the model or SFT recipe changes, so cached models are rebuilt.
RECIPE = "arith-slip0-sft600x128-v2"


def ensure_tiny_model(out: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    out = out.resolve()
    if (out / DONE).exists() and not force:
        if json.loads((out / DONE).read_text()).get("recipe") == RECIPE:
            return out
    from services.trainer.sft import sft_warm_start
    from services.trainer.tiny_model import build_model

    base = out.parent / (out.name + "-base")
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    log(f"building tiny model in {base}")
    build_model(base)
    log("SFT warm-start with TRL (about a minute on 2 cores)")
    sft_warm_start(base, out)
    shutil.rmtree(out / "_sft_run", ignore_errors=True)
    (out / DONE).write_text(json.dumps({"base": str(base), "recipe": RECIPE}))
    return out


# The teacher of the distillation test: the tiny SFT model trained further on clean demos
# (the right sum, then EOS, every time), so it is much better than the student it starts from.
TEACHER_RECIPE = "arith-teacher-clean300x128-v1"


def ensure_teacher_model(out: Path, student: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Build (once) a same-tokenizer teacher from the tiny student by a longer, clean SFT."""
    out, student = out.resolve(), student.resolve()
    want = {"student": str(student), "recipe": TEACHER_RECIPE, "student_recipe": RECIPE}
    if (out / DONE).exists() and not force and json.loads((out / DONE).read_text()) == want:
        return out
    from services.trainer.sft import sft_warm_start

    shutil.rmtree(out, ignore_errors=True)
    log(f"building the distillation teacher in {out} (SFT of {student} on clean demonstrations)")
    sft_warm_start(student, out, steps=300, batch_size=128, learning_rate=1e-3, seed=1, correct_fraction=1.0)
    shutil.rmtree(out / "_sft_run", ignore_errors=True)
    (out / DONE).write_text(json.dumps(want))
    return out
