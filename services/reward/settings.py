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

    # The python tool (POST /v1/sandbox/run, the "python" environment's backend). Limits are the
    # service's: a caller only chooses a timeout, and only up to tool_max_timeout_s.
    tool_concurrency: int = Field(
        2, ge=1, le=256, description="Sandbox runs served at once by /v1/sandbox/run; more wait (then 503 busy)."
    )
    tool_max_timeout_s: float = Field(
        10.0, gt=0, le=120, description="Ceiling on a /v1/sandbox/run request's timeout_s (wall clock of one run)."
    )
    tool_memory_mb: int = Field(256, ge=32, le=16384, description="Address-space limit of one tool run.")
    tool_max_output: int = Field(
        65536, ge=1024, le=1 << 22, description="Characters of stdout kept per tool run (then output_limit)."
    )

    @property
    def plugin_modules(self) -> list[str]:
        return [m.strip() for m in self.plugins.split(",") if m.strip()]
