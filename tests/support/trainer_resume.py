"""One trainer job's world for the resume tests (one process, and FSDP across world sizes):
its groups, its Redis state and store, and a way to start (or restart) its trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load

from services.trainer.checkpoint import checkpoint_steps, load_checkpoint
from services.trainer.claim import claim_job
from services.trainer.loop import JobTrainer
from services.trainer.policy import ADAPTER_WEIGHTS
from services.trainer.settings import TrainerSettings
from shared import keys
from shared.bus import FIELD, Bus
from shared.lease import Lease
from shared.schema import Completion, GroupMsg, encode, pack_f32, pack_i32, pack_u8
from shared.store import FileStore
from tests.support.backlog import fake_rt
from tests.support.jobs import insert_running, small_spec

JOB = "resume-1"
STEPS, BATCH, G = 5, 2, 4
ZERO_VAR = {3, 8}  # positions in the stream of groups with equal rewards (dropped by dynamic sampling)


def resume_groups(steps: int = STEPS) -> list[GroupMsg]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(steps * BATCH + len(ZERO_VAR)):
        comps = []
        for j in range(G):
            t = int(rng.integers(3, 6))
            comps.append(
                Completion(
                    token_ids=pack_i32(rng.integers(3, 200, t)),
                    logprobs=pack_f32(-rng.random(t) * 3 - 0.5),
                    loss_mask=pack_u8(np.ones(t, dtype=np.uint8)),
                    text="x",
                    finish_reason="stop",
                    reward=1.0 if i in ZERO_VAR else float((i + j) % 2),
                )
            )
        out.append(
            GroupMsg(
                job_id=JOB,
                group_id=f"{JOB}:g{i}",
                item_id=str(i),
                prompt="p",
                prompt_ids=pack_i32(rng.integers(3, 200, 3)),
                policy_version=0,
                completions=comps,
                stage="ready",
            )
        )
    return out


class Run:
    """One job's world: Redis state, a store, and a way to start (or restart) its trainer."""

    def __init__(  # noqa: ANN001
        self, r, tmp: Path, model_dir: Path, *, checkpoint_every: int, steps: int = STEPS, data_steps: int = STEPS
    ) -> None:
        r.flushall()
        self.r = r
        self.store = FileStore(tmp / "store")
        algorithm = {"dynamic_sampling": True, "warmup_steps": 3, "lr_schedule": "cosine"}
        spec = small_spec(
            model_dir,
            name="resume",
            group=G,
            batch=BATCH,
            steps=steps,
            learning_rate=5e-3,
            max_staleness=64,
            algorithm=algorithm,
        )
        insert_running(r, JOB, spec)
        Bus.ensure_groups(r, JOB)
        groups = resume_groups(data_steps)
        for g in groups:
            r.xadd(keys.ready(JOB), {FIELD: encode(g)})
        r.hset(keys.ledger(JOB), "fed", len(groups))  # as if the api had fed them
        self.settings = TrainerSettings(
            job=JOB, device="cpu", checkpoint_every=checkpoint_every, budget_margin_s=0, dev=True
        )
        self.lease: Lease | None = None

    def trainer(self) -> JobTrainer:
        """A trainer that takes the job's lease as the service does (each one a new holder)."""
        rt = fake_rt(self.r)
        if self.lease is not None:  # the previous one crashed or exited: the service releases its lease
            self.lease.release()
        claimed = claim_job(rt, self.settings, self.store)  # type: ignore[arg-type]
        assert claimed is not None, "the previous trainer still holds the lease"
        rec, self.lease = claimed
        return JobTrainer(rt, self.settings, self.store, rec, lease=self.lease)  # type: ignore[arg-type]

    def final(self) -> tuple[dict[str, torch.Tensor], float]:
        step = max(checkpoint_steps(self.store, JOB))
        assert step == STEPS
        ck = load_checkpoint(self.store, JOB, step)
        return load(ck.files[ADAPTER_WEIGHTS]), ck.param_groups[0]["lr"]


def crash_before_ack(monkeypatch, step: int) -> None:  # noqa: ANN001 (pytest's MonkeyPatch)
    """The trainer raises right after storing checkpoint `step`, before acknowledging it: the
    interval it holds is in the store but still pending on the bus. Undo with monkeypatch.undo()."""
    _raise_in(
        monkeypatch, "_ack_checkpointed", step, f"injected crash after storing checkpoint {step}, before acking it"
    )


def crash_before_publish(monkeypatch, step: int) -> None:  # noqa: ANN001 (pytest's MonkeyPatch)
    """The trainer raises after training step `step`, before publishing it or storing its
    checkpoint: the groups since the last checkpoint are trained but held nowhere. Undo with
    monkeypatch.undo()."""
    _raise_in(monkeypatch, "_publish", step, f"injected crash after training step {step}, before its checkpoint")


def _raise_in(monkeypatch, method: str, step: int, message: str) -> None:  # noqa: ANN001
    """JobTrainer.`method` raises RuntimeError(message) when called at training step `step`."""
    orig = getattr(JobTrainer, method)

    def boom(self, *args):  # noqa: ANN001, ANN002, ANN202
        if self.state.step == step:
            raise RuntimeError(message)
        return orig(self, *args)

    monkeypatch.setattr(JobTrainer, method, boom)
