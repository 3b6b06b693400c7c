"""The job shapes more than one benchmark runs, so that each is written once.

The demo's job is the default workload: its group size, batch and KL weight are what the
comparisons hold both sides to (bench/trl_compare.py, bench/trainer_passes.py, bench/burst.py)."""

from __future__ import annotations

from typing import Any

from services.cli.demo import DEMO_JOB

# The demo's job (minus its name): what every stack benchmark runs unless it varies something.
DEMO_SHAPE: dict[str, Any] = {k: v for k, v in DEMO_JOB.items() if k != "name"}
G: int = DEMO_SHAPE["group_size"]  # completions per prompt
BATCH: int = DEMO_SHAPE["batch_size"]  # prompts (groups) per optimizer step
KL: float = DEMO_SHAPE["kl_coef"]

# A burst's job: the demo's shape without KL (no ref service: the inference side is rollout and
# reward), evaluated afterwards off every clock, never completing within a run. bench/burst.py's
# setups start from it; bench/trainer_startup.py times a trainer starting on it.
BURST_JOB: dict[str, Any] = {
    **DEMO_SHAPE,
    "steps": 100_000,
    "kl_coef": 0.0,
    "eval_size": 0,
    "seed": 0,
}

# A backlog that outlasts any run (bench/backlog.py's idle runs, bench/burst.py's backlog setups).
BACKLOG: dict[str, Any] = {"max_groups": 100_000, "segment_groups": 32, "max_age_versions": 1000, "order": "oldest"}
