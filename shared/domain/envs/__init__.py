"""Environments for multi-turn and tool-use episodes, registered by name (pure Python).

Built in: "calc" (a calculator tool, with its task "arith3"), "python" (Python code run in
the code sandbox, on the reward service or locally, with its task "arith3py") and "guess"
(a number-guessing game, with its task "guess"). Importing this package registers them, and
their tasks, in every process that imports shared.job (the api feeds their prompts, reward
scores them).
"""

from __future__ import annotations

from shared.domain.envs import calc as _calc  # noqa: F401  (registers env "calc", task "arith3")
from shared.domain.envs import guess as _guess  # noqa: F401  (registers env "guess", task "guess")
from shared.domain.envs import python_tool as _python_tool  # noqa: F401  (registers env "python", task "arith3py")
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
