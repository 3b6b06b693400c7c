"""Tasks: a prompt source, a train/held-out split and a verifier, registered by name (the
built-ins in shared/domain/catalog.py).

Pure Python (no torch): the api feeds prompts from here, the reward service scores
with the verifier, and rollout's held-out evaluation uses both.
"""

from __future__ import annotations

from shared.domain.tasks.base import (
    Task,
    TaskItem,
    get_task,
    make_task,
    register_task,
    score_many,
    task_for_job,
    task_names,
)

__all__ = ["Task", "TaskItem", "get_task", "make_task", "register_task", "score_many", "task_for_job", "task_names"]
