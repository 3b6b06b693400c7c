"""The planner's settings in the services' own words: every key it emits is a field of
`services/trainer/settings.py`, `services/rollout/settings.py` or `services/ref/settings.py`,
with the same name and meaning (tests/integration/test_plan.py walks every key against those models).

The planner keeps its own, finer memory knobs (`memory.TrainerKnobs`: rows per micro-batch,
fp32 adapters, allocator slack...); this module is the one place that turns them into service
settings, and into the environment lines each service reads (`BURSTRL_<ROLE>_<FIELD>`). The
planner does not import the services (a role never imports another role), so the names are
written here and the test holds them to the settings classes.

What is not a service setting (which weights vLLM serves, how many replicas or torchrun
processes to start) goes in a role's `layout`, never in `recommended`/`min_settings`.
"""

from __future__ import annotations

from typing import Any

from services.plan.memory import ServeSettings, TrainerKnobs, Workload

ENV_PREFIX = {"trainer": "BURSTRL_TRAINER_", "rollout": "BURSTRL_ROLLOUT_", "ref": "BURSTRL_REF_"}
# torch dtype names, as the services' dtype settings spell them.
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The rollout settings that configure vLLM's engine when it is built in-process; a remote
# server takes them as `vllm serve` flags instead (see `serve_flags`).
ENGINE_KEYS = (
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_dtype",
    "tensor_parallel_size",
)


def trainer_settings(s: TrainerKnobs, w: Workload) -> dict[str, Any]:
    """The trainer service's settings for the planner's trainer knobs `s`.

    - micro_batch_tokens: the planner sizes activations for `micro_batch` rows of
      prompt + completion tokens; the trainer bounds its passes by padded tokens.
    - logits_chunk: 0 when the estimate assumed no chunking (its peak is then an upper bound
      for any chunk size the trainer picks); otherwise the chunk the estimate used.
    - sharding: the planner's fsdp_shards k > 1 is FSDP over k torchrun processes; 1 is
      one process per card (DDP when there are several, see the role's layout).
    """
    if s.dtype not in ("bf16", "fp32"):
        raise ValueError(f"the trainer has no {s.dtype} mode (its dtype is auto, bfloat16 or float32)")
    return {
        "dtype": TORCH_DTYPE[s.dtype],
        "micro_batch_tokens": s.micro_batch * w.seq_len,
        "gradient_checkpointing": s.gradient_checkpointing,
        "logits_chunk": s.logits_chunk or 0,
        "optimizer": s.optimizer,
        "base_bits": s.base_bits,
        "cpu_offload": s.cpu_offload,
        "sharding": "fsdp" if s.fsdp_shards > 1 else "ddp",
    }


def trainer_layout(world: int) -> dict[str, Any]:
    """How to launch the trainer: one process per card, under torchrun when there are several."""
    out: dict[str, Any] = {"processes": world}
    if world > 1:
        out["launcher"] = f"torchrun --nproc-per-node={world} -m services.trainer"
    return out


def rollout_settings(s: ServeSettings, tp: int, gpu_memory_utilization: float, dtype: str) -> dict[str, Any]:
    """The rollout service's engine settings. The planner's kv_dtype bf16/fp16 is the model's
    own dtype, which vLLM calls "auto"; fp8 is vLLM's "fp8". `dtype` is the compute dtype:
    the card's 16-bit type, fp16 for GPTQ/AWQ kernels."""
    return {
        "dtype": TORCH_DTYPE["fp16" if s.weights in ("gptq", "awq") else dtype],
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "kv_cache_dtype": "fp8" if s.kv_dtype == "fp8" else "auto",
        "tensor_parallel_size": tp,
    }


def ref_settings(micro_batch: int, w: Workload, dtype: str, logits_chunk: int) -> dict[str, Any]:
    """The ref service's settings: max_batch_tokens is its padded tokens per forward pass."""
    return {
        "max_batch_tokens": max(1, micro_batch) * w.seq_len,
        "logits_chunk": logits_chunk,
        "dtype": TORCH_DTYPE[dtype],
    }


def env_value(v: Any) -> str:
    """How pydantic-settings reads a value back from the environment."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def env_vars(role: str, settings: dict[str, Any]) -> dict[str, Any]:
    """`{"gradient_checkpointing": True}` -> `{"BURSTRL_TRAINER_GRADIENT_CHECKPOINTING": True}`."""
    return {f"{ENV_PREFIX[role]}{k.upper()}": v for k, v in settings.items()}


def serve_flags(settings: dict[str, Any]) -> list[str]:
    """The engine settings as `vllm serve` flags, for a remote engine (e.g. the gfx906 fork's
    container), which the rollout service cannot configure."""
    return [f"--{k.replace('_', '-')}={env_value(settings[k])}" for k in ENGINE_KEYS if k in settings]
