"""Reward service settings: env BURSTRL_REWARD_* for its own fields, BURSTRL_* for common ones."""

from __future__ import annotations

import os

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import CommonSettings


class RewardSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="BURSTRL_REWARD_", extra="ignore")

    plugins: str = Field(
        "",
        description="Comma-separated modules imported at start (and in every scoring process) that register "
        "verifiers or tasks. Only the operator chooses code to load: jobs can only name what is registered.",
    )
    workers: int = Field(
        max(1, min(4, os.cpu_count() or 1)),
        ge=0,
        le=256,
        description="Scoring processes (groups are scored in parallel); 0 scores in this process (debugging).",
    )
    batch: int = Field(32, ge=1, le=4096, description="Groups read from the streams per iteration.")
    timeout_s: float = Field(
        120.0, gt=0, description="Ceiling on any job's task_spec.timeout_s (deadline to score one group)."
    )

    @property
    def plugin_modules(self) -> list[str]:
        return [m.strip() for m in self.plugins.split(",") if m.strip()]
