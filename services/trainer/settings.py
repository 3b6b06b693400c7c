from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import CommonSettings


class TrainerSettings(CommonSettings):
    """trainer settings: env BURSTRL_TRAINER_* for its own fields, BURSTRL_* for common ones."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_TRAINER_", extra="ignore")

    job: str = Field("", description="Train this job id only; empty: claim any running job.")
    device: str = Field("auto", description="cpu, cuda, or auto.")
    lease_s: int = Field(30, ge=5, description="Job lease TTL; another trainer may take over after it.")
    grad_clip: float = Field(1.0, gt=0, description="Max gradient norm.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default).")
