"""Environments for multi-turn and tool-use episodes, registered by name (pure Python).

Built in: "calc" (a calculator tool, with its task "arith3"), "python" (Python code run in
the code sandbox, on the reward service or locally, with its task "arith3py") and "guess"
(a number-guessing game, with its task "guess"). They, and their tasks, are registered in
shared/domain/catalog.py: any process finds them by name (the api feeds their prompts, reward
scores them, the trainer probes them) without importing this package first.
"""

from __future__ import annotations

from shared.domain.envs.base import Env, EnvError, StepResult, env_names, load_env_plugins, make_env, register_env
from shared.env_spec import EnvSpec

__all__ = [
    "Env",
    "EnvError",
    "EnvSpec",
    "StepResult",
    "env_names",
    "load_env_plugins",
    "make_env",
    "register_env",
]
