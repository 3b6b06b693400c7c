"""FSDP2 sharding (`torch.distributed.fsdp.fully_shard`) and its CPU offload, for the trainer.

`sharding = fsdp` under torchrun with k processes shards the weights, gradients and AdamW
states of the policy over the k ranks: each decoder layer is its own FSDP unit (all-gathered
for its forward and backward, then freed), the embeddings, final norm and head are the root
unit. Full fine-tuning and LoRA both work: under LoRA the frozen base is sharded too, and only
the adapter has gradients and optimizer states. `cpu_offload = true` keeps the sharded
weights, gradients and optimizer states in host RAM (FSDP2's CPUOffloadPolicy: the optimizer
steps on the CPU, each unit's weights are copied to the GPU for its compute); it is a CUDA
feature. On one process it shards nothing and only offloads (a one-rank group).

What the rest of the trainer sees does not change:
- The learner's losses carry the mini-batch's global token and sequence counts, so gradients
  are *summed* over ranks (the divide factor is 1, not FSDP's default mean over ranks).
- Checkpoints and policy versions hold full, unsharded tensors in the same safetensors files
  the one-process trainer writes: every rank gathers (`full_tensor`, a collective) and rank 0
  writes. So a checkpoint written on k ranks loads on any other number of ranks, or in the
  plain one-process path, unchanged. We gather rather than use torch.distributed.checkpoint
  because DCP's file format keeps its metadata as a pickle (docs/architecture.md, invariant 1:
  nothing pickled) and its shards are not what the one-process path or vLLM read. The cost is
  a full copy of what is gathered in rank 0's host RAM at save time: under LoRA only the adapter
  and its optimizer states, under full fine-tuning the whole model and its AdamW states.
- Loading a full checkpoint: each rank reads the same files from the store and keeps its own
  shard (no communication); `nn.Module.load_state_dict` accepts full tensors through a hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


class ShardingError(ValueError):
    """A sharding or offload setting that cannot run here: raised at start-up, never worked around."""


def resolve_device(device: str) -> str:
    """The trainer's `device` setting with auto resolved as the trainer resolves it."""
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def check_sharding(*, sharding: str, cpu_offload: bool, world: int, device: str) -> None:
    """Refuse, naming the setting and what to use instead, a sharding or offload choice that
    cannot run on this device and process count (issue 22: never a silent fallback)."""
    if sharding == "fsdp" and world < 2:
        raise ShardingError(
            "BURSTRL_TRAINER_SHARDING=fsdp needs torchrun with 2 or more processes (WORLD_SIZE is "
            f"{world}): FSDP shards weights over processes, and one process has nothing to shard. Use "
            "sharding=ddp for one process (with cpu_offload=true on a CUDA card to keep weights and "
            "optimizer states in host RAM), or launch `torchrun --nproc-per-node=K -m services.trainer`."
        )
    if cpu_offload and not device.startswith("cuda"):
        raise ShardingError(
            f"BURSTRL_TRAINER_CPU_OFFLOAD=true needs a CUDA device (device is {device}): it moves weights "
            "and optimizer states from the GPU to host RAM, where a CPU trainer keeps them already. Set "
            "cpu_offload=false on CPU."
        )
    if cpu_offload and sharding == "ddp" and world > 1:
        raise ShardingError(
            f"BURSTRL_TRAINER_CPU_OFFLOAD=true with {world} torchrun processes needs sharding=fsdp: the "
            "offload is FSDP2's offload policy, and ddp keeps a full replica on every card. Set "
            "BURSTRL_TRAINER_SHARDING=fsdp."
        )


def wants_fsdp(*, sharding: str, cpu_offload: bool) -> bool:
    return sharding == "fsdp" or cpu_offload


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _ensure_group(device: str) -> None:
    """A process group for FSDP: torchrun's (distributed.Comm made it), or for offload on one
    process a one-rank group that needs no rendezvous."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (the classes HF keeps unsplit, e.g. Qwen2DecoderLayer)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ShardingError(f"{type(base).__name__} names no decoder layer class (_no_split_modules) to shard by")
    return layers


def shard_model(model: nn.Module, *, device: str, cpu_offload: bool) -> nn.Module:
    """Shard `model` in place over the default process group (one FSDP unit per decoder layer,
    plus the root) and return it. Every rank must hold the same initial weights (load_policy
    seeds them), since fully_shard keeps each rank's own slice without broadcasting."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    _ensure_group(device)
    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # The learner's losses are already divided by global counts: sum over ranks. A
            # plain SUM (forced), not PREMUL_SUM(1/1), which gloo lacks.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    model.register_load_state_dict_pre_hook(_full_to_shards)
    return model


def _full_to_shards(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: a full tensor for a sharded parameter becomes this rank's
    shard of it (src_data_rank=None: every rank holds the full tensor, nothing is sent)."""
    params = dict(module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False))
    for k, v in list(state_dict.items()):
        p = params.get(k)
        if isinstance(p, DTensor) and not isinstance(v, DTensor):
            state_dict[k] = distribute_tensor(v.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole tensor (a collective for a sharded one: every rank calls it).
    A copy even of a CPU tensor: AdamW's `step` counters change in place at the next update."""
    if isinstance(t, DTensor):
        return t.full_tensor().detach().cpu()
    return t.detach().to("cpu", copy=True)


def full_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full tensors of every trainable parameter, by name (LoRA: the adapter only)."""
    return {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict as full CPU tensors; a tensor under two names (tied embeddings)
    stays one tensor, so save_pretrained writes it once as the one-process trainer does."""
    seen: dict[int, torch.Tensor] = {}
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen[id(v)] = _full(v)
        out[k] = seen[id(v)]
    return out


def gathered_policy_files(model: nn.Module, base_model: str, *, main: bool) -> dict[str, bytes]:
    """`policy.policy_files` of a sharded model: every rank gathers, rank 0 (`main`) gets the files."""
    from services.trainer.policy import adapter_files, full_files, is_lora

    if is_lora(model):
        sd = full_trainable_state(model)
        return adapter_files(model, base_model, state_dict=sd) if main else {}
    sd = full_state(model)
    return full_files(model, state_dict=sd) if main else {}


def full_optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """`checkpoint.optimizer_to_tensors` of an optimizer over sharded parameters: the same
    keys (state.{index}.{name}) holding full tensors, so any world size can load them. Every
    rank calls it, in the same order (sorted), since each gather is a collective."""
    sd = opt.state_dict()
    tensors = {}
    for idx in sorted(sd["state"]):
        st = sd["state"][idx]
        for name in sorted(st):
            val = st[name]
            t = val if torch.is_tensor(val) else torch.tensor(val)
            tensors[f"state.{idx}.{name}"] = _full(t).contiguous()
    return tensors, sd["param_groups"]


def local_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's full optimizer tensors with each sharded parameter's states cut to this
    rank's shard, ready for `checkpoint.optimizer_from_tensors` (no communication)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    out = dict(tensors)
    for key, t in tensors.items():
        if not key.startswith("state."):
            continue
        _, idx, _name = key.split(".", 2)
        p = params[int(idx)]
        if isinstance(p, DTensor) and tuple(t.shape) == tuple(p.shape):  # exp_avg and co., not `step`
            out[key] = distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
    return out
