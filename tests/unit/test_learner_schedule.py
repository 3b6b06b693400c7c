"""The learning-rate schedule is applied in order (issue 44, item 9): the optimizer's k-th update
(counting from 0) runs at the schedule's value for k, in a fresh learner and in one resumed from a
checkpoint in the store, and torch raises neither of its scheduler-order warnings ("optimizer.step()
has been overridden after learning rate scheduler initialization", "Detected call of
lr_scheduler.step() before optimizer.step()").

The rates are recorded by a step pre-hook (torch's own API) at the moment each update runs."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from services.trainer.build import restore_newest
from services.trainer.checkpoint import TrainState, save_checkpoint
from services.trainer.learner import Learner
from services.trainer.policy import load_policy, policy_files
from shared.job import JobSpec
from shared.store import FileStore
from tests.support.trainer_groups import random_groups, tiny_model

LR, WARMUP, STEPS, MINIBATCHES = 1e-2, 2, 4, 2
UPDATES = STEPS * MINIBATCHES  # one optimizer step per mini-batch


def schedule(k: int) -> float:
    """The job's schedule written out by hand: linear warm-up to LR over WARMUP updates, then
    cosine to 0 at UPDATES."""
    if k < WARMUP:
        return LR * (k + 1) / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * (k - WARMUP) / (UPDATES - WARMUP)))


def _learner(model_dir: Path) -> tuple[Learner, list[float]]:
    spec = JobSpec(
        base_model=str(model_dir),
        group_size=2,
        batch_size=2,
        steps=STEPS,
        learning_rate=LR,
        algorithm={"minibatches": MINIBATCHES, "warmup_steps": WARMUP, "lr_schedule": "cosine"},
    )
    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0)
    learner = Learner(model, spec, pad_id=tok.pad_token_id or 0, grad_clip=1.0)
    used: list[float] = []
    learner.opt.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    return learner, used


def _train(learner: Learner, batches: range) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler", category=UserWarning)
        for i in batches:
            learner.train_batch(random_groups(seed=i))


def test_each_update_runs_at_the_schedules_value_for_its_index(tmp_path: Path) -> None:
    learner, used = _learner(tiny_model(tmp_path))
    _train(learner, range(STEPS))
    assert used == pytest.approx([schedule(k) for k in range(UPDATES)], rel=1e-9)
    assert used[0] == pytest.approx(LR / WARMUP) and used[WARMUP] == pytest.approx(LR)  # nothing skipped


def test_a_resumed_learner_continues_the_schedule_where_the_checkpoint_left_it(tmp_path: Path) -> None:
    model_dir, store = tiny_model(tmp_path), FileStore(tmp_path / "store")
    first, _ = _learner(model_dir)
    _train(first, range(2))
    save_checkpoint(store, "job", TrainState(step=2), policy_files(first.model, str(model_dir)), first.opt, first.sched)
    # The trainer's restore (services/trainer/build.py), into a fresh learner.
    second, used = _learner(model_dir)
    state = restore_newest(store, "job", second.model, second.opt, sched=second.sched)
    assert state is not None and state.step == 2
    _train(second, range(2, STEPS))
    assert used == pytest.approx([schedule(k) for k in range(2 * MINIBATCHES, UPDATES)], rel=1e-9)
