"""The job spec: what a user submits to `POST /v1/jobs` (or in a job TOML file).

One pydantic model, validated at the api's door; every stage reads the stored copy
from Redis, so what the stages act on is exactly what the api accepted. Defaults are
the tiny-model demo's settings.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import TYPE_CHECKING, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared import keys

if TYPE_CHECKING:
    import redis

JOB_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,47}$")


class JobState(StrEnum):
    pending = "pending"
    running = "running"
    paused = "paused"
    completed = "completed"
    cancelled = "cancelled"
    failed = "failed"


class SamplingSpec(BaseModel):
    """How rollout samples. Temperature 1 keeps sampler log-probs exact (see ARCHITECTURE)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, gt=0.0, le=2.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(8, ge=1, le=8192, description="Completion length cap.")


class JobSpec(BaseModel):
    """A GRPO training job. Field docs are served in the OpenAPI schema."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("job", description="Lowercase name, [a-z0-9-], used in job ids.")
    base_model: str = Field(
        ...,
        min_length=1,
        description="Hub id or local path of the base model; the reference when training LoRA.",
    )
    task: str = Field("arith", description="Registered task name (prompt source + verifier).")
    verifier: str = Field("", description="Verifier override; empty uses the task's own.")
    group_size: int = Field(8, ge=2, le=256, description="Completions per prompt (G).")
    batch_size: int = Field(8, ge=1, le=4096, description="Groups per optimizer step.")
    steps: int = Field(20, ge=1, le=1_000_000, description="Optimizer steps (policy versions).")
    learning_rate: float = Field(2e-3, gt=0.0, le=1.0, description="AdamW learning rate.")
    lora_rank: int = Field(16, ge=1, le=256, description="LoRA rank (vLLM supports 8..256).")
    lora_alpha: int = Field(32, ge=1, le=1024, description="LoRA alpha.")
    kl_coef: float = Field(0.0, ge=0.0, le=10.0, description="KL-to-reference weight; 0 skips ref.")
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip below 1 (epsilon_low).")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="PPO clip above 1 (DAPO).")
    tis_cap: float = Field(2.0, ge=1.0, description="Truncated importance-sampling cap.")
    max_staleness: int = Field(1, ge=0, le=64, description="Max policy versions a sample may lag.")
    eval_size: int = Field(64, ge=0, le=100_000, description="Held-out prompts per evaluation.")
    seed: int = Field(0, ge=0, description="Seeds prompt order and the trainer.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)

    @field_validator("name")
    @classmethod
    def _name_is_slug(cls, v: str) -> str:
        if not JOB_NAME_RE.match(v):
            raise ValueError("name must match [a-z0-9][a-z0-9-]{0,47} (lowercase, digits, '-')")
        return v

    @model_validator(mode="after")
    def _alpha_sane(self) -> Self:
        if self.lora_alpha > 16 * self.lora_rank:
            raise ValueError("lora_alpha above 16 x lora_rank makes LoRA updates explode")
        return self

    @property
    def uses_ref(self) -> bool:
        """The ref stage runs only when there is a KL term."""
        return self.kl_coef > 0.0

    @property
    def inflight_window(self) -> int:
        """Groups allowed beyond what the trainer consumed (ARCHITECTURE invariant 4)."""
        return (self.max_staleness + 1) * self.batch_size


class JobRecord(BaseModel):
    """A job as stored in Redis and returned by the api."""

    id: str
    spec: JobSpec
    state: JobState = JobState.pending
    created_at: float
    updated_at: float
    error: str = ""


def same_model(a: str, b: str) -> bool:
    """Whether two base-model references name the same model (local paths resolved)."""
    from pathlib import Path

    def norm(x: str) -> str:
        p = Path(x).expanduser()
        return str(p.resolve()) if p.exists() else x

    return a == b or norm(a) == norm(b)


def load_job(r: redis.Redis, job_id: str) -> JobRecord | None:
    """The api's stored copy of a job (what every stage acts on)."""
    raw = r.hget(keys.jobs_index(), job_id)
    return JobRecord.model_validate_json(raw) if raw else None


def save_job(r: redis.Redis, rec: JobRecord) -> None:
    r.hset(keys.jobs_index(), rec.id, rec.model_dump_json())
