"""A job's environment block (`JobSpec.env`): which environment, and the episode limits.

Empty `name` keeps the job single-turn, exactly as before.
"""

from __future__ import annotations

from pydantic import Field

from shared.limits import ARGS_MAX_KEYS, ArgKey, ArgScalar, SpecModel


class EnvSpec(SpecModel):
    name: str = Field(
        "",
        max_length=48,
        pattern=r"^[A-Za-z0-9_.-]{0,48}$",
        description="Registered environment (calc, guess, or a rollout plugin's); empty: single-turn completions.",
    )
    args: dict[ArgKey, ArgScalar] = Field(
        default_factory=dict, max_length=ARGS_MAX_KEYS, description="Keyword arguments of the environment."
    )
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode.")
    max_tokens: int = Field(
        128,
        ge=1,
        le=32768,
        description="Tokens after the prompt per episode (generated + observations); sampling.max_tokens caps "
        "each turn.",
    )
    max_seconds: float = Field(60.0, gt=0.0, le=3600.0, description="Wall-clock limit per episode.")
    step_timeout_s: float = Field(
        5.0, gt=0.0, le=600.0, description="Deadline of one reset/step call; a miss ends the episode (env_timeout)."
    )
