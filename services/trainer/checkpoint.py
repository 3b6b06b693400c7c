"""Trainer checkpoints in the object store: weights, optimizer, scheduler, RNG and progress.

jobs/{job}/trainer/step-{N}/ holds the policy files (LoRA adapter or full weights),
optimizer.safetensors (optimizer state + torch RNG states) and state.json (step, the
scheduler, python/numpy RNG, data position, the groups of the last interval) in a write-once
subfolder of the writer's (step-{N}/e{epoch}-{random}/: shared/folders.py, `put_folder`), then
manifest.json (sha256 of each, and that subfolder) written last: a checkpoint without a
manifest does not exist, and every hash is checked on load. A deposed trainer that wakes in
the middle of its upload writes only into its own subfolder, never over the files its
successor's manifest names, and its manifest goes in only where none of a newer lease epoch
is (`put_manifest`: it gets LeaseLost instead; the live holder replaces a deposed one's
manifest at its step). (Checkpoints written before the subfolders hold their files beside
the manifest and load as before.) Everything is safetensors or JSON; nothing is pickled.

Why `trained_groups` holds only the groups trained since the previous checkpoint: the
trainer acknowledges a group on the bus right after the checkpoint containing it is
stored, and checkpoints are written in order, so when checkpoint N is written every group
of checkpoints < N has already been acknowledged and can never be redelivered. Only the
last interval's groups can come back (a crash between storing N and acknowledging its
groups), and those are what a resumed trainer must recognise and acknowledge instead of
re-training. That bounds state.json by checkpoint_every x batch_size ids. (A stream-id
watermark would be smaller, but entries are not trained in stream order: pending entries
are redelivered first and dropped ones are skipped, so a watermark cannot tell them apart.)
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load, save

from shared.fence import refusal
from shared.folders import MANIFEST, get_folder, new_data_dir, put_folder
from shared.policy import DeposedWrite
from shared.store import ObjectStore, VerificationError

log = logging.getLogger(__name__)

OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"


@dataclass
class TrainState:
    step: int = 0
    trained_groups: list[str] = field(default_factory=list)  # groups of the last checkpoint interval only
    # Data position: totals consumed from the ready stream and the last entry id trained.
    data: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Checkpoint:
    state: TrainState
    files: dict[str, bytes]  # the policy files (adapter or full weights)
    opt_tensors: dict[str, torch.Tensor]
    param_groups: list[dict]
    scheduler: dict[str, Any] | None
    rng: dict[str, Any]


def ckpt_prefix(job_id: str, step: int) -> str:
    return f"jobs/{job_id}/trainer/step-{step:08d}"


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The optimizer's per-parameter state as flat safetensors keys, and its param groups (JSON).

    `state.{idx}.{name}` holds a tensor; `pystate.{idx}.{name}` a Python number (bitsandbytes'
    8-bit AdamW keeps `step` as an int and must get an int back). A nested dict (bitsandbytes
    wraps its quantization tensors in one) flattens to `{name}.{inner}`."""
    sd = opt.state_dict()
    tensors = {}
    seen: set[int] = set()

    def put(idx: int, name: str, val: object) -> None:
        if isinstance(val, dict):
            for k, v in val.items():
                put(idx, f"{name}.{k}", v)
        elif torch.is_tensor(val):
            t = val.detach().cpu().contiguous()
            # safetensors refuses tensors that share storage (bitsandbytes gives every
            # parameter the same quantization maps): those few KB are stored once per key.
            ptr = t.untyped_storage().data_ptr()
            tensors[f"state.{idx}.{name}"] = t.clone() if ptr in seen else t
            seen.add(ptr)
        else:
            tensors[f"pystate.{idx}.{name}"] = torch.tensor(val)

    for idx, st in sd["state"].items():
        for name, val in st.items():
            put(idx, name, val)
    return tensors, sd["param_groups"]


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        kind, _, rest = key.partition(".")
        if kind not in ("state", "pystate"):  # e.g. "rng.torch" shares the file
            continue
        idx, *path = rest.split(".")
        node = state.setdefault(int(idx), {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = t if kind == "state" else t.item()
    opt.load_state_dict({"state": state, "param_groups": groups})


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """A scheduler state dict minus what JSON cannot hold (LambdaLR stores its lambdas as None)."""
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
        except TypeError:
            continue
        out[k] = v
    return out


def rng_capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every RNG the trainer might draw from: torch (CPU, each GPU) as tensors, python/numpy as JSON."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }
    return tensors, meta


def rng_restore(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if "python" in meta:
        v, keys, gauss = meta["python"]
        random.setstate((v, tuple(keys), gauss))
    if "numpy" in meta:
        kind, keys, pos, has_gauss, gauss = meta["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def save_checkpoint(
    store: ObjectStore,
    job_id: str,
    state: TrainState,
    files: dict[str, bytes],
    opt: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    epoch: int = 0,
    before_manifest: Callable[[], None] | None = None,
    opt_state: tuple[dict[str, torch.Tensor], list[dict]] | None = None,
) -> str:
    """Upload files, optimizer and state, then the manifest (the checkpoint exists from then on).

    `epoch`: the writer's lease epoch, kept in the manifest so readers can refuse a deposed
    trainer's checkpoint (shared/fence.py); `before_manifest` may raise to abandon it.
    `opt_state`: `opt`'s tensors and param groups when the caller gathered them already (FSDP:
    services/trainer/sharding.py), in the same format, so the checkpoint loads at any world size."""
    tensors, groups = opt_state if opt_state is not None else optimizer_to_tensors(opt)
    tensors = dict(tensors)
    rng_tensors, rng_meta = rng_capture()
    tensors.update(rng_tensors)
    out = dict(files)
    out[OPTIMIZER] = save(tensors)
    out[STATE] = json.dumps(
        {
            "step": state.step,
            "trained_groups": state.trained_groups,
            "data": state.data,
            "extra": state.extra,
            "param_groups": groups,
            "scheduler": _jsonable(scheduler.state_dict()) if scheduler is not None else None,
            "rng": rng_meta,
        }
    ).encode()
    prefix = ckpt_prefix(job_id, state.step)
    meta = {"step": state.step, "epoch": epoch}
    put_folder(store, prefix, out, meta, before_manifest=before_manifest, data_dir=new_data_dir(epoch))
    return prefix


def checkpoint_steps(store: ObjectStore, job_id: str) -> list[int]:
    """Steps with a complete (manifested) checkpoint, ascending."""
    keys = store.list(f"jobs/{job_id}/trainer/")
    return sorted(int(k.split("/")[3][5:]) for k in keys if k.endswith("/" + MANIFEST) and k.count("/") == 4)


def latest_checkpoint(store: ObjectStore, job_id: str) -> int | None:
    steps = checkpoint_steps(store, job_id)
    return steps[-1] if steps else None


def load_checkpoint(store: ObjectStore, job_id: str, step: int) -> Checkpoint:
    """The verified files of a checkpoint (raises VerificationError on any hash mismatch, and
    DeposedWrite for a checkpoint a deposed trainer wrote)."""
    manifest, files = get_folder(store, ckpt_prefix(job_id, step))
    if why := refusal(store, job_id, "checkpoint", step, int(manifest.get("epoch", 0))):
        raise DeposedWrite(why)
    meta = json.loads(files.pop(STATE))
    opt_tensors = load(files.pop(OPTIMIZER))
    state = TrainState(
        step=meta["step"], trained_groups=meta["trained_groups"], data=meta.get("data", {}), extra=meta["extra"]
    )
    return Checkpoint(state, files, opt_tensors, meta["param_groups"], meta.get("scheduler"), meta.get("rng", {}))


def load_newest_valid(store: ObjectStore, job_id: str) -> Checkpoint | None:
    """The newest checkpoint that verifies; ones whose files do not match their manifest are skipped.

    Only verification failures are skipped: an unreachable store raises, so an outage
    never makes the trainer fall back to an older checkpoint (or to none).
    """
    for step in reversed(checkpoint_steps(store, job_id)):
        try:
            return load_checkpoint(store, job_id, step)
        except (VerificationError, ValueError) as e:  # ValueError: a manifest or state.json that is not JSON
            log.error("job %s: checkpoint step %d is corrupt, skipped (never loaded): %s", job_id, step, e)
    return None


def prune_checkpoints(store: ObjectStore, job_id: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` checkpoints: manifest first, so none is ever half there.
    Returns the steps of the checkpoints kept."""
    steps = checkpoint_steps(store, job_id)
    gone = steps[:-keep] if keep > 0 else []
    for step in gone:
        prefix = ckpt_prefix(job_id, step)
        store.delete(f"{prefix}/{MANIFEST}")
        for key in store.list(prefix + "/"):
            store.delete(key)
    return [s for s in steps if s not in gone]
