from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from shared.settings import CommonSettings


class TrainerSettings(CommonSettings):
    """trainer settings: env BURSTRL_TRAINER_* for its own fields, BURSTRL_* for common ones.

    Session concerns (time budget, checkpoint cadence, memory tricks) live here rather than
    in the job spec: they describe the machine and the rental, not the experiment.
    """

    model_config = SettingsConfigDict(env_prefix="BURSTRL_TRAINER_", extra="ignore")

    job: str = Field("", description="Train this job id only; empty: claim any running job.")
    device: str = Field("auto", description="cpu, cuda, or auto.")
    lease_s: int = Field(
        30,
        ge=5,
        description="Job lease TTL: how long a dead trainer's job waits for another. A thread renews the lease "
        "every lease_s/3 during steps and uploads, so it need not cover a step.",
    )
    republish_probe_tolerance: float = Field(
        0.02,
        gt=0.0,
        description="A version already in the store when this trainer reaches its step is kept only if its probe "
        "log-probs agree with this trainer's weights within this mean difference; else it is published again.",
    )
    stuck_groups: int = Field(
        64,
        ge=0,
        description="Fail the job when this many groups in a row arrive sampled on a version rollout should have "
        "replaced (stale_grace_s after a fresher one was published): rollout cannot adopt new versions. 0: never.",
    )
    stuck_grace_s: float = Field(60.0, gt=0.0, description="See stuck_groups: the time rollout has to adopt a version.")
    max_attempts: int = Field(
        3, ge=1, description="Fail a job after this many consecutive failed attempts to load or train it."
    )
    grad_clip: float = Field(1.0, gt=0, description="Max gradient norm.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default).")
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="Checkpoint (and acknowledge) every N steps; also at exit, and sooner whenever the groups "
        "trained since the last checkpoint fill the job's in-flight window (the next batch could not come "
        "before their ack). Versions publish every step.",
    )
    wait_report_s: float = Field(
        60.0,
        ge=0.0,
        allow_inf_nan=False,
        description="Once no batch has formed for this long, say so: the `progress` check of /readyz turns "
        "degraded with what holds the batch up (the feeder's window, groups still upstream), and the log says "
        "it. 0: never.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept in the store; older ones are deleted.")
    keep_versions: int = Field(
        16,
        ge=0,
        description="Policy versions kept in the store: the newest N, plus every keep_versions_every-th, the best "
        "evaluated one, and any a rollout replica serves or a checkpoint's step names (services/trainer/"
        "retention.py). 0: keep every version.",
    )
    keep_versions_every: int = Field(50, ge=0, description="Also keep every Kth policy version (0: none).")
    time_budget_s: float = Field(
        0.0, ge=0.0, description="Session length in seconds from process start; 0: unlimited (--time-budget)."
    )
    deadline: float = Field(0.0, ge=0.0, description="Session end as a unix time; 0: none (--deadline).")
    leave_when_idle_s: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="Burst sessions: exit (checkpointed, code 0) once no batch has formed for this many "
        "seconds and no backlog segment is left, so a drained backlog stops the billing; 0: wait for "
        "more data forever (--leave-when-idle).",
    )
    budget_margin_s: float = Field(
        10.0, ge=0.0, description="Safety margin kept on top of the measured step and save times."
    )
    grace_s: float = Field(
        30.0, gt=0.0, description="Expected time between SIGTERM and SIGKILL (pre-emption); only for warnings."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    micro_batch_tokens: int | None = Field(
        None,
        ge=0,
        description=(
            "Padded tokens per forward/backward pass: rows sorted by length, run in passes of at most this "
            "many (rows x the pass's longest row), gradients accumulated; the update is the same. Cuts "
            "padding waste on uneven completions and bounds activation memory. 0: one pass per mini-batch. "
            "Unset: sized from the model's shape for a 2 GiB activation budget (shared/ml/pass_tokens.py)."
        ),
    )
    # The memory savers `burstrl plan` names (issue 22). Their names, types and meanings are fixed
    # here so the planner's vocabulary test can hold it to them.
    logits_chunk: int = Field(
        0,
        ge=0,
        description="Tokens per chunked log-prob pass (per-token log-probs computed this many tokens at a time, "
        "recomputed in backward, so fp32 [tokens x vocab] logits never exist for a whole pass). 0: auto.",
    )
    optimizer: Literal["adamw", "adamw8bit"] = Field("adamw", description="AdamW, or 8-bit AdamW states.")
    base_bits: Literal[16, 4] = Field(16, description="LoRA: bits of the frozen base weights; 4 = NF4 (QLoRA).")
    cpu_offload: bool = Field(
        False,
        description="Keep parameters, gradients and optimizer states in host RAM (FSDP2's CPUOffloadPolicy; "
        "services/trainer/sharding.py). CUDA only: refused at start-up on CPU. On one process it offloads "
        "without sharding; under torchrun it needs sharding=fsdp.",
    )
    sharding: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Across torchrun processes: ddp replicates the model on every card; fsdp (FSDP2) shards "
        "weights, grads and optimizer states over them. `burstrl plan`'s k-card FSDP means fsdp under "
        "torchrun with k processes; fsdp on one process is refused at start-up (use ddp).",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="Compute dtype: auto = bfloat16 on cuda, float32 on cpu."
    )

    @field_validator("base_bits", mode="before")
    @classmethod
    def _bits_from_env(cls, v: object) -> object:
        # The environment gives "4"; a Literal of ints only matches ints.
        return int(v) if isinstance(v, str) and v.strip().isdigit() else v
