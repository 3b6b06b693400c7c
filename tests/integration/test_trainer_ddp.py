"""Data parallel: 2 CPU processes on gloo take the same step as 1 process on the same global batch.

Rank 0 broadcasts the groups as msgpack bytes (Comm.broadcast_bytes), each rank trains its
share of every mini-batch with the global token count as denominator, and gradients are
summed with all_reduce. Odd group counts per mini-batch (3 -> 2 + 1) and two PPO epochs
make the uneven split and the PPO anchor part of the check.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.cli.launch import free_port
from shared.job import JobSpec
from tests.support.trainer_groups import dp_spec, join_gloo, rank_comm, spawn_ranks, tiny_model, train_broadcast_steps


def _spec(model: Path) -> JobSpec:
    return dp_spec(model, learning_rate=1e-2, algorithm={"minibatches": 2, "ppo_epochs": 2, "entropy_coef": 0.01})


def _train(model_dir: Path, out: Path, world: int, rank: int) -> None:
    from peft import get_peft_model_state_dict

    from services.trainer.learner import Learner
    from services.trainer.policy import load_policy

    comm = rank_comm(world)
    spec = _spec(model_dir)
    model, tok = load_policy(str(model_dir), rank=8, alpha=16, device="cpu", seed=0)
    learner = Learner(model, spec, pad_id=tok.pad_token_id or 0, grad_clip=1.0, world=comm.world, rank=comm.rank)
    # Plain SGD for the comparison: Adam divides by sqrt(v), which turns float-order noise in
    # near-zero gradients (LoRA A while B is ~0) into lr-sized differences and hides any
    # uniform scale error; SGD weights are linear in the gradients, so the check is strict.
    learner.opt = torch.optim.SGD(learner.params, lr=0.5)
    learner.sched = torch.optim.lr_scheduler.LambdaLR(learner.opt, lambda _: 1.0)
    stats = train_broadcast_steps(learner, comm)
    if comm.is_main:
        tensors = {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
        # Adam is blind to a uniform gradient scale, so the reported norms and losses are compared too.
        tensors["_stats"] = torch.tensor(stats, dtype=torch.float64)
        save_file(tensors, str(out))


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join_gloo(rank, world, port)
    _train(Path(model_dir), Path(out), world, rank)
    torch.distributed.destroy_process_group()


def test_two_gloo_processes_match_one_process(tmp_path):
    model_dir = tiny_model(tmp_path)
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    _train(model_dir, one, 1, 0)
    spawn_ranks(
        _worker, (2, free_port(), str(model_dir), str(two)), "the two ranks hung (a collective one rank did not join)"
    )
    a, b = load_file(str(one)), load_file(str(two))
    assert a.keys() == b.keys() and len(a) > 1
    assert torch.allclose(a.pop("_stats"), b.pop("_stats"), rtol=1e-4, atol=1e-6)
    for k in a:  # the same weights, up to float summation order
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k
    assert any(float(v.abs().sum()) > 0 for k, v in a.items() if "lora_B" in k)  # the adapter did move
