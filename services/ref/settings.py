from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from shared.settings import CommonSettings


class RefSettings(CommonSettings):
    """ref settings: env BURSTRL_REF_* for its own fields, BURSTRL_* for common ones.

    A replica serves one model. It scores a job's groups only when that model is the job's
    reference: the job's `teacher` when set, else its `base_model` (the LoRA's base).
    """

    model_config = SettingsConfigDict(env_prefix="BURSTRL_REF_", extra="ignore")

    model: str = Field(..., description="Reference model: a job's base model, or a teacher (hub id or local path).")
    engine: Literal["hf", "vllm", "remote"] = Field(
        "hf",
        description="hf: transformers in this process (numerics of the trainer's forward pass); vllm: vLLM in "
        "this process (prompt_logprobs); remote: an OpenAI-compatible vLLM server at engine_url.",
    )
    engine_url: str = Field("", description="Remote mode: base URL of the vLLM server (no /v1), e.g. http://box:8000.")
    engine_api_key: SecretStr = Field(SecretStr(""), description="Remote mode: the server's --api-key, if any.")
    engine_served_model: str = Field(
        "", description="Remote mode: the server's model name; empty takes the one /v1/models lists."
    )
    engine_timeout_s: float = Field(300.0, gt=0, description="Remote mode: per-request timeout.")
    engine_concurrency: int = Field(8, ge=1, description="Remote mode: requests in flight at once.")
    engine_retry_s: float = Field(10.0, gt=0, description="Wait between attempts to start/reach the engine.")
    device: str = Field("cpu", description="hf engine: cpu or cuda.")
    threads: int = Field(
        0,
        ge=0,
        description="hf engine: torch CPU threads (0: torch's default, every core). Where other services share "
        "the cores, give it its share: idle OpenMP threads spin and steal them.",
    )
    dtype: str = Field(
        "auto",
        description="hf: auto = the trainer's choice (bf16 on cuda, fp32 on cpu); vllm: passed to vLLM "
        "(auto runs fp32 checkpoints in bf16 on CPU; set float32 for exact agreement).",
    )
    max_model_len: int = Field(0, ge=0, description="vllm engine context; 0 takes the model's.")
    tokenizer: str = Field(
        "",
        description="Tokenizer checked against each job's base model's; empty: the model's own (remote: if loadable).",
    )
    batch_groups: int = Field(16, ge=1, description="Groups read and scored together.")
    max_batch_tokens: int | None = Field(
        None,
        ge=16,
        description="hf engine: padded tokens per forward pass (rows x longest sequence). Unset: sized from "
        "the model's shape for a 1 GiB activation budget (shared/ml/pass_tokens.py).",
    )
    logits_chunk: int = Field(
        0,
        ge=0,
        description="hf engine: tokens per chunked log-prob pass (fp32 [tokens x vocab] logits never exist "
        "for a whole pass). 0: auto.",
    )
