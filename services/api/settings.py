from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import CommonSettings


class ApiSettings(CommonSettings):
    """api service settings (env prefix BURSTRL_API_, common ones BURSTRL_)."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_API_", extra="ignore")

    feed_interval_s: float = Field(
        0.2,
        gt=0,
        description="Longest wait between prompt top-ups (the feeder also wakes when a job records progress).",
    )
