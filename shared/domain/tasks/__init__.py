"""Tasks: a prompt source, a train/held-out split and a verifier, registered by name.

Pure Python (no torch): the api feeds prompts from here, the reward service scores
with the verifier, and rollout's held-out evaluation uses both.
"""

from __future__ import annotations

from shared.domain.tasks import arith as _arith  # noqa: F401  (registers "arith")
from shared.domain.tasks import countup as _countup  # noqa: F401  (registers "countup")
from shared.domain.tasks import rg as _rg  # noqa: F401  (registers the "rg:<dataset>" family: reasoning-gym)
from shared.domain.tasks import synthetic as _synthetic  # noqa: F401  (registers "mathword", "code")
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
