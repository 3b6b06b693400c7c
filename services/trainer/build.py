"""Building what a trainer trains: the job's policy on its device (sharded under FSDP), the
size of its passes, its learner, and the newest checkpoint restored into them.

The job trainer (loop.py, `JobTrainer`) gets all of it from `build_trainable`; the Tinker
worker (tinker/model.py, `TinkerModel`), which keeps its own AdamW and no Learner, loads its
policy, sizes its passes and restores its checkpoints with the same functions, so a job's
weights load and come back one way in both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.checkpoint import TrainState, load_newest_valid, optimizer_from_tensors, rng_restore
from services.trainer.distributed import Comm
from services.trainer.learner import Learner
from services.trainer.optim import check_resume
from services.trainer.policy import load_policy, load_policy_files
from services.trainer.settings import TrainerSettings
from services.trainer.sharding import local_optimizer_tensors, resolve_device, shard_model, wants_fsdp
from shared.job import JobRecord, JobSpec
from shared.ml.pass_tokens import trainer_pass_tokens
from shared.store import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class Trainable:
    """A job's policy, ready to train: where the newest checkpoint left it, or fresh."""

    model: Any  # a peft model under LoRA, else the transformers model (FSDP-sharded when `sharded`)
    tok: Any
    sharded: bool
    learner: Learner
    state: TrainState


def load_job_policy(spec: JobSpec, device: str, *, gradient_checkpointing: bool = False, base_bits: int = 16):  # noqa: ANN201
    """The job's base model with a fresh adapter (or all its weights trainable), seeded by the job."""
    return load_policy(
        spec.base_model,
        rank=spec.lora_rank,
        alpha=spec.lora_alpha,
        device=device,
        seed=spec.seed,
        finetune=spec.algorithm.finetune,
        gradient_checkpointing=gradient_checkpointing,
        base_bits=base_bits,
    )


def pass_tokens(model: Any, settings: TrainerSettings, job_id: str, *, gradient_checkpointing: bool) -> int:
    """The padded tokens per forward/backward pass: the user's micro_batch_tokens, else sized
    from the model's shape (shared/ml/pass_tokens.py)."""
    n = trainer_pass_tokens(
        model.config,
        setting=settings.micro_batch_tokens,
        logits_chunk=settings.logits_chunk,
        gradient_checkpointing=gradient_checkpointing,
    )
    if settings.micro_batch_tokens is None:
        log.info("job %s: micro_batch_tokens unset: %d from the model's shape", job_id, n)
    return n


def restore_newest(
    store: ObjectStore,
    job_id: str,
    model: Any,
    opt: torch.optim.Optimizer,
    *,
    optimizer: str = "adamw",
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
    sharded: bool = False,
) -> TrainState | None:
    """Put the newest valid checkpoint (hashes verified; corrupt ones skipped) into the model, the
    optimizer (and the scheduler) and the RNGs; its TrainState, or None when there is none."""
    ck = load_newest_valid(store, job_id)
    if ck is None:
        return None
    load_policy_files(model, ck.files)  # into the fresh adapter: never applied on top of another
    check_resume(optimizer, ck.opt_tensors)  # adamw state never loads into adamw8bit
    opt_tensors = local_optimizer_tensors(opt, ck.opt_tensors) if sharded else ck.opt_tensors
    optimizer_from_tensors(opt, opt_tensors, ck.param_groups)
    if sched is not None and ck.scheduler:
        # Restores last_epoch without stepping; the optimizer's lr came back with its param groups.
        sched.load_state_dict(ck.scheduler)
    rng_restore(ck.opt_tensors, ck.rng)
    return ck.state


def build_trainable(settings: TrainerSettings, store: ObjectStore, rec: JobRecord, comm: Comm) -> Trainable:
    """Load the job's policy, shard it (FSDP2: before the optimizer exists, so that it holds the
    shards), build its learner and restore the newest checkpoint into them. The trainer's
    __main__ has already refused settings that cannot run here (check_sharding, check_savers)."""
    spec = rec.spec
    device = resolve_device(settings.device)
    model, tok = load_job_policy(
        spec, device, gradient_checkpointing=settings.gradient_checkpointing, base_bits=settings.base_bits
    )
    sharded = wants_fsdp(sharding=settings.sharding, cpu_offload=settings.cpu_offload)
    if sharded:
        model = shard_model(model, device=device, cpu_offload=settings.cpu_offload)
    learner = Learner(
        model,
        spec,
        pad_id=tok.pad_token_id or 0,
        grad_clip=settings.grad_clip,
        device=device,
        world=comm.world,
        rank=comm.rank,
        micro_batch_tokens=pass_tokens(model, settings, rec.id, gradient_checkpointing=settings.gradient_checkpointing),
        optimizer=settings.optimizer,
        logits_chunk=settings.logits_chunk,
    )
    state = restore_newest(
        store, rec.id, model, learner.opt, optimizer=settings.optimizer, sched=learner.sched, sharded=sharded
    )
    if state is not None:
        log.info("job %s: resumed from checkpoint step %d", rec.id, state.step)
    return Trainable(model, tok, sharded, learner, state or TrainState())
