"""The catalog of built-in tasks, environments and verifiers, by name: the one place they are registered.

No module in shared/domain registers anything when it is imported. Each registry loads the
built-ins of its kind from these tables the first time it is used (`Registry` in
shared/plugins.py), finding each by "module:attribute" as Python's entry points do. So a
registry imports none of the modules it holds: the environments' companion tasks ("arith3"
beside "calc") live with their environments in shared/domain/envs, which imports the task
interface (shared/domain/tasks/base.py), and the task registry reaches them by name, never by an
import back up (the import-linter contract on shared.domain's layers, pyproject.toml).

Plugin modules a service's settings name (BURSTRL_REWARD_PLUGINS, BURSTRL_ROLLOUT_ENV_PLUGINS)
add theirs with `register_task`, `register_env` and `register_verifier` when they are imported.
"""

from __future__ import annotations

TASKS = {
    "arith": "shared.domain.tasks.arith:ArithTask",
    "countup": "shared.domain.tasks.countup:CountUpTask",
    "mathword": "shared.domain.tasks.synthetic:MathWordTask",
    "code": "shared.domain.tasks.synthetic:CodeTask",
    # The environments' companion tasks.
    "arith3": "shared.domain.envs.calc:Arith3Task",
    "arith3py": "shared.domain.envs.python_tool:Arith3PyTask",
    "guess": "shared.domain.envs.guess:GuessTask",
}

# Families of tasks named "<prefix><name>", built with options (`task_spec.args`).
TASK_FAMILIES = {
    "rg:": "shared.domain.tasks.rg:RgTask",  # reasoning-gym's datasets: "rg:<dataset>"
}

ENVS = {
    "calc": "shared.domain.envs.calc:CalcEnv",
    "guess": "shared.domain.envs.guess:GuessEnv",
    "python": "shared.domain.envs.python_tool:python_env",
}

VERIFIERS = {
    "exact": "shared.domain.verifiers.basic:exact",
    "regex": "shared.domain.verifiers.basic:regex",
    "format": "shared.domain.verifiers.basic:format_check",
    "overlong": "shared.domain.verifiers.basic:overlong",
    "math": "shared.domain.verifiers.math_answer:math_equiv",
    "code": "shared.domain.verifiers.code:code_tests",
    "http": "shared.domain.verifiers.http:http_rm",
    "openai_judge": "shared.domain.verifiers.http:openai_judge",
}

# What the api runs on a job's verifier args at submission (a 422 naming the field).
VERIFIER_ARG_CHECKS = {
    "regex": "shared.domain.verifiers.basic:check_pattern_args",
    "format": "shared.domain.verifiers.basic:check_pattern_args",
    "overlong": "shared.domain.verifiers.basic:check_overlong_args",
    "code": "shared.domain.verifiers.code:check_code_args",
    "http": "shared.domain.verifiers.http:check_http_args",
    "openai_judge": "shared.domain.verifiers.http:check_judge_args",
}
