"""Trainer checkpoints in the object store: adapter, optimizer, RNG and progress.

jobs/{job}/trainer/step-{N}/ holds adapter_model.safetensors, adapter_config.json,
optimizer.safetensors and state.json, then manifest.json (sha256 of each) written
last: a checkpoint without a manifest does not exist, and hashes are checked on load.
Everything is safetensors or JSON; nothing is pickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load, save

from shared.store import MANIFEST, ObjectStore, get_folder, put_folder


@dataclass
class TrainState:
    step: int = 0
    trained_groups: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def ckpt_prefix(job_id: str, step: int) -> str:
    return f"jobs/{job_id}/trainer/step-{step:08d}"


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for name, val in st.items():
            t = val if torch.is_tensor(val) else torch.tensor(val)
            tensors[f"state.{idx}.{name}"] = t.detach().cpu().contiguous()
    return tensors, sd["param_groups"]


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith("state."):  # e.g. "rng.torch" shares the file
            continue
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(
    store: ObjectStore, job_id: str, state: TrainState, adapter: dict[str, bytes], opt: torch.optim.Optimizer
) -> str:
    tensors, groups = optimizer_to_tensors(opt)
    tensors["rng.torch"] = torch.get_rng_state()
    files = dict(adapter)
    files["optimizer.safetensors"] = save(tensors)
    files["state.json"] = json.dumps(
        {"step": state.step, "trained_groups": state.trained_groups, "extra": state.extra, "param_groups": groups}
    ).encode()
    prefix = ckpt_prefix(job_id, state.step)
    put_folder(store, prefix, files, {"step": state.step})
    return prefix


def latest_checkpoint(store: ObjectStore, job_id: str) -> int | None:
    steps = [int(k.split("/")[3][5:]) for k in store.list(f"jobs/{job_id}/trainer/") if k.endswith("/" + MANIFEST)]
    return max(steps) if steps else None


def load_checkpoint(
    store: ObjectStore, job_id: str, step: int
) -> tuple[TrainState, dict[str, bytes], dict[str, torch.Tensor], list[dict]]:
    """Verified files of a checkpoint: state, adapter files, optimizer tensors, param groups."""
    _, files = get_folder(store, ckpt_prefix(job_id, step))
    meta = json.loads(files.pop("state.json"))
    opt_tensors = load(files.pop("optimizer.safetensors"))
    state = TrainState(step=meta["step"], trained_groups=meta["trained_groups"], extra=meta["extra"])
    return state, files, opt_tensors, meta["param_groups"]
