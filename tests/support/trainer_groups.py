"""Trainer cases shared by the data-parallel, loss, mode and multi-turn tests: a small locally
built model, random but valid groups, and groups whose sampler log-probs sit near the policy's own."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.trainer.policy import load_policy
from shared.job import JobSpec
from shared.ml.threads import set_threads
from shared.schema import Completion, GroupMsg, decode, encode, pack_f32, pack_i32, pack_u8

if TYPE_CHECKING:
    from services.trainer.distributed import Comm
    from services.trainer.learner import Learner

GROUPS, G = 6, 4


def tiny_model(root: Path) -> Path:
    from shared.ml.tiny_model import build_model

    out = root / "tiny"
    if not (out / "config.json").exists():
        build_model(out, hidden=64, layers=2, seed=0)
    return out


def make_groups(n: int, g: int, *, seed: int, job_id: str = "job-1", version: int = 0) -> list[GroupMsg]:
    """Random but valid groups: varied lengths, a masked token, rewards with spread."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        comps = []
        for j in range(g):
            t = int(rng.integers(3, 7))
            mask = np.ones(t, dtype=np.uint8)
            if j == 1:
                mask[1] = 0  # a tool-output token: not trained on
            comps.append(
                Completion(
                    token_ids=pack_i32(rng.integers(3, 200, t)),
                    logprobs=pack_f32(-rng.random(t) * 4 - 0.5),
                    loss_mask=pack_u8(mask),
                    text="x",
                    finish_reason="stop",
                    reward=float(rng.integers(0, 2)) if j else float(i % 2),
                )
            )
        out.append(
            GroupMsg(
                job_id=job_id,
                group_id=f"{job_id}:g{seed}-{i}",
                item_id=str(i),
                prompt="p",
                prompt_ids=pack_i32(rng.integers(3, 200, int(rng.integers(2, 5)))),
                policy_version=version,
                completions=comps,
                stage="ready",
            )
        )
    return out


def ready_group(
    i: int, completions: list[Completion], prompt_ids: Sequence[int], *, prompt: str = "p", group_id: str = ""
) -> GroupMsg:
    """Group `i` of job "j" as the trainer reads it: ready, sampled at policy version 0; its id
    `g{i}` unless `group_id` is given."""
    return GroupMsg(
        job_id="j",
        group_id=group_id or f"g{i}",
        item_id=str(i),
        prompt=prompt,
        prompt_ids=pack_i32(list(prompt_ids)),
        policy_version=0,
        completions=completions,
        stage="ready",
    )


def random_groups(n: int = 2, g: int = 2, *, seed: int = 3, tokens: int = 4, tag: str = "") -> list[GroupMsg]:
    """`n` ready groups of `g` completions on the prompt [5, 6, 7]: `tokens` random ids each, all
    trained on, reward j for the j-th (torch's generator, so the draws are the same on every box).
    Group ids `g{tag}{i}` (a tag keeps the groups of different seeds apart)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        comps = [
            Completion(
                token_ids=pack_i32(torch.randint(3, 200, (tokens,), generator=gen).tolist()),
                logprobs=pack_f32((-torch.rand(tokens, generator=gen) * 3).tolist()),
                loss_mask=pack_u8([1] * tokens),
                text="x",
                finish_reason="stop",
                reward=float(j),
            )
            for j in range(g)
        ]
        out.append(ready_group(i, comps, [5, 6, 7], group_id=f"g{tag}{i}"))
    return out


def near_policy(groups: list[GroupMsg], model_dir: Path, *, noise: float, seed: int = 11) -> list[GroupMsg]:
    """The groups with sampler log-probs = the tiny model's own + Gaussian noise: a sampler a
    little off the trainer (quantized, a version or two stale), so masks and weights act on
    some tokens but not all (the random log-probs of `_uneven_groups` are ~4 nats off)."""
    from services.trainer.batch import collate
    from shared.ml.logprobs import token_logprobs

    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0)
    b = collate(groups, tok.pad_token_id)
    with torch.no_grad():
        logp = token_logprobs(
            model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1], b.input_ids[:, 1:]
        )
    gen = torch.Generator().manual_seed(seed)
    comps = [c for g in groups for c in g.completions]
    for i, c in enumerate(comps):
        own = logp[i, b.offsets[i] : b.offsets[i] + b.lengths[i]]
        c.logprobs = pack_f32((own + noise * torch.randn(len(own), generator=gen)).tolist())
    return groups


# -- data parallel: the DDP and FSDP tests' ranks -------------------------------------------------
def dp_spec(model_dir: Path, **over: Any) -> JobSpec:
    """The data-parallel tests' job: GROUPS groups of G a step, two steps; `over` on top."""
    return JobSpec(base_model=str(model_dir), group_size=G, batch_size=GROUPS, steps=2, **over)


def join_gloo(rank: int, world: int, port: int) -> None:
    """Make this process rank `rank` of `world` on 127.0.0.1:`port`, as Comm.from_env reads it."""
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank)}
    )


def spawn_ranks(worker: Callable[..., None], args: tuple[Any, ...], hung: str, *, nprocs: int = 2) -> None:
    """`worker(rank, *args)` on `nprocs` spawned ranks, waited for. Ranks that disagree on a
    collective hang rather than fail: after 300 s they are killed and the test fails, saying `hung`."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(hung)


def rank_comm(world: int) -> Comm:
    """This rank's Comm (none to join for one process), on one CPU thread: the ranks share the cores."""
    from services.trainer.distributed import Comm

    set_threads(1)
    return Comm.from_env() if world > 1 else Comm()


def train_broadcast_steps(learner: Learner, comm: Comm, steps: int = 2) -> list[list[float]]:
    """`steps` steps on groups rank 0 makes (make_groups, seeded by the step) and broadcasts as
    bytes; each rank trains its share. Per step: grad norm, loss, entropy, mismatch KL."""
    stats = []
    for step in range(steps):
        mine = make_groups(GROUPS, G, seed=step) if comm.is_main else None
        data = comm.broadcast_bytes([encode(x) for x in mine] if mine else None)
        res = learner.train_batch([decode(b, GroupMsg) for b in data])
        stats.append([res.grad_norm, res.stats["loss"], res.stats["entropy"], res.stats["mismatch_kl"]])
    return stats
