from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import CommonSettings


class RolloutSettings(CommonSettings):
    """rollout settings: env BURSTRL_ROLLOUT_* for its own fields, BURSTRL_* for common ones."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_ROLLOUT_", extra="ignore")

    model: str = Field(..., description="Base model served (hub id or local path); jobs must match.")
    max_model_len: int = Field(256, ge=16, description="Engine context length.")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank the engine accepts.")
    max_loras: int = Field(4, ge=1, description="Adapters resident at once (>= max_staleness + 2).")
    dtype: str = Field("auto", description="Engine dtype: auto, float32, bfloat16, float16.")
    prompts_per_batch: int = Field(8, ge=1, description="Prompts pulled per engine call.")
    eval_samples: int = Field(4, ge=1, description="Samples per held-out prompt (pass@1 estimate).")
    seed: int = Field(0, description="Engine seed.")
