"""M2PO under data parallelism: 2 gloo processes mask what 1 process masks, and take its step.

M2PO's cutoff is a property of the whole mini-batch, while each rank holds the trainer's
log-probs of its own rows only; the learner gathers every rank's squared log-ratios before
the first backward. Without that each rank would mask by its own rows' M2, and the step (and
the reported mask fraction) would differ from the one-process step checked here. The second
step trains one group, so rank 1 has no rows at all and must still join the gather.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from services.cli.launch import free_port
from shared.schema import GroupMsg, decode, encode
from tests.support.trainer_groups import (
    GROUPS,
    G,
    dp_spec,
    join_gloo,
    make_groups,
    near_policy,
    rank_comm,
    spawn_ranks,
    tiny_model,
)


def _train(model_dir: Path, data: Path, out: Path, world: int, rank: int) -> None:
    from peft import get_peft_model_state_dict

    from services.trainer.learner import Learner
    from services.trainer.policy import load_policy

    comm = rank_comm(world)
    spec = dp_spec(model_dir, algorithm={"mismatch": "m2po", "minibatches": 2})  # 3 groups a mini-batch: 2 + 1
    model, tok = load_policy(str(model_dir), rank=8, alpha=16, device="cpu", seed=0)
    learner = Learner(model, spec, pad_id=tok.pad_token_id or 0, grad_clip=1.0, world=comm.world, rank=comm.rank)
    learner.opt = torch.optim.SGD(learner.params, lr=0.5)  # linear in the gradients (see test_trainer_ddp)
    learner.sched = torch.optim.lr_scheduler.LambdaLR(learner.opt, lambda _: 1.0)
    groups = [decode(b, GroupMsg) for b in msgspec.msgpack.decode(data.read_bytes())]
    keys = ("mask_frac", "m2", "ess", "loss")
    stats = []
    for batch in (groups, groups[:1]):  # the second: one group, nothing for rank 1
        res = learner.train_batch(batch)
        stats.append([res.grad_norm] + [res.stats[k] for k in keys])
    if comm.is_main:
        tensors = {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
        tensors["_stats"] = torch.tensor(stats, dtype=torch.float64)
        save_file(tensors, str(out))


def _worker(rank: int, world: int, port: int, model_dir: str, data: str, out: str) -> None:
    join_gloo(rank, world, port)
    _train(Path(model_dir), Path(data), Path(out), world, rank)
    torch.distributed.destroy_process_group()


def test_m2po_over_two_gloo_processes_matches_one_process(tmp_path):
    model_dir = tiny_model(tmp_path)
    groups = near_policy(make_groups(GROUPS, G, seed=3), model_dir, noise=0.5)  # the sampler a little off
    data = tmp_path / "groups.msgpack"
    data.write_bytes(msgspec.msgpack.encode([encode(g) for g in groups]))
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    _train(model_dir, data, one, 1, 0)
    args = (2, free_port(), str(model_dir), str(data), str(two))
    spawn_ranks(_worker, args, "the two ranks did not finish: a collective that only one of them joined")
    a, b = load_file(str(one)), load_file(str(two))
    sa, sb = a.pop("_stats"), b.pop("_stats")
    assert (0.0 < sa[:, 1]).all() and (sa[:, 1] < 1.0).all()  # M2PO masked some tokens, not all
    assert torch.allclose(sa, sb, rtol=1e-4, atol=1e-6), (sa, sb)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k
    assert any(float(v.abs().sum()) > 0 for k, v in a.items() if "lora_B" in k)
