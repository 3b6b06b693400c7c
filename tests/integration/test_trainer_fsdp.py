"""FSDP2: 2 CPU processes on gloo, sharded with fully_shard, take the step 1 process takes.

The model is the tiny SFT model (the `tiny_model` fixture, .burstrl/models/tiny-sft: 4 Qwen2
layers, tied embeddings), sharded one FSDP unit per decoder layer plus the root, under LoRA
(frozen base sharded too) and under full fine-tuning. Each rank trains its share of every
mini-batch (3 groups per mini-batch: ranks get 2 and 1) in passes of at most 24 padded tokens,
so rank 0 runs more passes than rank 1, which must run idle ones to join each pass's
collectives; FSDP's reduce-scatter sums the gradients, and two PPO epochs make the anchor pass
part of the check.

Compared with the unsharded one-process run: the gradients of every optimizer update (gathered
inside the optimizer's step), the reported grad norms and losses, and the final weights.
Tolerance, fp32: atol 1e-5 + rtol 1e-4 on gradients and weights. The sharded run sums the
same per-row terms in another order (reduce-scatter of two partial sums instead of one
backward over all rows); measured on this setup the largest differences are 8.3e-8 in
weights and 1.2e-7 in gradients (LoRA), 2.3e-6 and 4.7e-6 (full, after 8 SGD updates at lr
0.5), in weights of magnitude ~1e-2 to 1. A scale
error (FSDP's default mean over ranks instead of a sum) would be a factor of 2, a wrong row
split or a missing idle pass a difference of the gradients' own size (1e-2 and up).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save_file

from services.cli.launch import free_port
from services.trainer.sharding import ShardingError, check_sharding
from shared.job import JobSpec
from shared.ml.threads import set_threads
from tests.support import ROOT
from tests.support.trainer_groups import (
    GROUPS,
    G,
    dp_spec,
    join_gloo,
    make_groups,
    rank_comm,
    spawn_ranks,
    train_broadcast_steps,
)

RTOL, ATOL = 1e-4, 1e-5
UPDATES = 8  # 2 steps x 2 PPO epochs x 2 mini-batches
MICRO_TOKENS = 24  # passes of 2-4 rows: rank 0's 8 rows of a mini-batch take more than rank 1's 4


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the full gradient of every update (a gather under FSDP: every rank steps)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], lr: float) -> None:
        super().__init__([p for _, p in named], lr=lr)
        self.names = [n for n, _ in named]
        self.grads: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):  # noqa: ANN001, ANN201
        from services.trainer.sharding import _full

        self.grads.append({n: _full(p.grad) for n, p in zip(self.names, self.param_groups[0]["params"], strict=True)})
        return super().step(closure)


def _train(model_dir: Path, out: Path, finetune: str, world: int) -> None:
    from services.trainer.learner import Learner
    from services.trainer.policy import load_policy
    from services.trainer.sharding import full_trainable_state, is_sharded, shard_model

    comm = rank_comm(world)
    algorithm = {"minibatches": 2, "ppo_epochs": 2, "entropy_coef": 0.01, "finetune": finetune}
    spec = dp_spec(model_dir, learning_rate=1e-2, algorithm=algorithm)
    model, tok = load_policy(str(model_dir), rank=8, alpha=16, device="cpu", seed=0, finetune=finetune)
    if world > 1:
        model = shard_model(model, device="cpu", cpu_offload=False)
        assert is_sharded(model)
    learner = Learner(
        model,
        spec,
        pad_id=tok.pad_token_id or 0,
        grad_clip=1.0,
        world=comm.world,
        rank=comm.rank,
        micro_batch_tokens=MICRO_TOKENS,
    )
    idle = [0]
    run_idle = learner._idle_pass

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        idle[0] += 1
        return run_idle(*a, **k)

    learner._idle_pass = counted
    # Plain SGD (see test_trainer_ddp): the weights are linear in the gradients, so the check is strict.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    learner.opt = RecordingSGD(named, lr=0.5)
    learner.sched = torch.optim.lr_scheduler.LambdaLR(learner.opt, lambda _: 1.0)
    stats = train_broadcast_steps(learner, comm)
    weights = full_trainable_state(model)  # a gather: every rank
    idle_total = comm.world > 1 and learner._all_sum([float(idle[0])])[0]
    if comm.is_main:
        tensors = {f"w.{k}": v.contiguous() for k, v in weights.items()}
        for i, grads in enumerate(learner.opt.grads):
            tensors.update({f"g{i}.{k}": v.contiguous() for k, v in grads.items()})
        tensors["_stats"] = torch.tensor(stats, dtype=torch.float64)
        tensors["_idle"] = torch.tensor([float(idle_total)])
        save_file(tensors, str(out))


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, finetune: str) -> None:
    join_gloo(rank, world, port)
    _train(Path(model_dir), Path(out), finetune, world)
    torch.distributed.destroy_process_group()


def _spawn(model_dir: Path, out: Path, finetune: str) -> None:
    args = (2, free_port(), str(model_dir), str(out), finetune)
    spawn_ranks(_worker, args, "the FSDP ranks hung (a collective one rank did not join)")


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_fsdp_over_two_gloo_processes_matches_one_process(tmp_path, tiny_model, finetune):
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    _train(tiny_model, one, finetune, 1)
    _spawn(tiny_model, two, finetune)
    a, b = load_file(str(one)), load_file(str(two))
    assert a.keys() == b.keys()
    assert float(a.pop("_idle")) == 0 and float(b.pop("_idle")) > 0  # the uneven pass counts were met
    assert sum(k.startswith("g") for k in a) == UPDATES * sum(k.startswith("w.") for k in a)
    assert torch.allclose(a.pop("_stats"), b.pop("_stats"), rtol=RTOL, atol=ATOL)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL), (k, float((a[k] - b[k]).abs().max()))
    # The check has teeth: the gradients are far from zero and far larger than the tolerance.
    assert max(float(v.abs().max()) for k, v in a.items() if k.startswith("g0.")) > 100 * ATOL
    if finetune == "lora":
        assert any(float(v.abs().sum()) > 0 for k, v in a.items() if k.startswith("w.") and "lora_B" in k)
    else:
        assert any("embed_tokens" in k for k in a)  # the tied embeddings were trained and gathered


# -- full fine-tuning checkpoints across world sizes (the store-level runs are LoRA:
# tests/integration/test_trainer_fsdp_resume.py) -------------------------------------------------------
def _full_learner(model_dir: Path, shard: bool):  # noqa: ANN202
    from services.trainer.learner import Learner
    from services.trainer.policy import load_policy
    from services.trainer.sharding import shard_model

    spec = JobSpec(base_model=str(model_dir), group_size=G, batch_size=GROUPS, steps=2, learning_rate=1e-3)
    spec.algorithm.finetune = "full"
    model, tok = load_policy(str(model_dir), rank=8, alpha=16, device="cpu", seed=0, finetune="full")
    if shard:
        model = shard_model(model, device="cpu", cpu_offload=False)
    learner = Learner(model, spec, pad_id=tok.pad_token_id or 0, grad_clip=1.0, world=2 if shard else 1, rank=0)
    return model, learner


def _write_ckpt(d: Path, files: dict[str, bytes], opt: tuple[dict[str, torch.Tensor], list[dict]]) -> None:
    import json

    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    save_file(opt[0], str(d / "_optimizer.safetensors"))
    (d / "_groups.json").write_text(json.dumps(opt[1]))


def _read_ckpt(d: Path) -> tuple[dict[str, bytes], dict[str, torch.Tensor], list[dict]]:
    import json

    files = {p.name: p.read_bytes() for p in d.iterdir() if not p.name.startswith("_")}
    return files, load_file(str(d / "_optimizer.safetensors")), json.loads((d / "_groups.json").read_text())


def _full_worker(rank: int, port: int, root: str, model_dir: str) -> None:
    """2 ranks: (1) train batch 0 from scratch and gather a checkpoint; (2) load the one-process
    checkpoint of batch 0, gather it back unchanged, train batch 1 and gather the weights."""
    from services.trainer.checkpoint import optimizer_from_tensors
    from services.trainer.policy import load_policy_files
    from services.trainer.sharding import (
        full_optimizer_tensors,
        full_state,
        gathered_policy_files,
        local_optimizer_tensors,
    )

    join_gloo(rank, 2, port)
    set_threads(1)
    torch.distributed.init_process_group("gloo")
    out = Path(root)
    model, learner = _full_learner(Path(model_dir), shard=True)
    learner.rank = rank
    learner.train_batch(make_groups(GROUPS, G, seed=0))
    files = gathered_policy_files(model, model_dir, main=rank == 0)
    opt = full_optimizer_tensors(learner.opt)
    if rank == 0:
        _write_ckpt(out / "two", files, opt)

    model, learner = _full_learner(Path(model_dir), shard=True)
    learner.rank = rank
    files, tensors, groups = _read_ckpt(out / "one")
    load_policy_files(model, files)
    optimizer_from_tensors(learner.opt, local_optimizer_tensors(learner.opt, tensors), groups)
    learner.sched.last_epoch = 1
    back = gathered_policy_files(model, model_dir, main=rank == 0)
    back_opt = full_optimizer_tensors(learner.opt)
    learner.train_batch(make_groups(GROUPS, G, seed=1))
    weights = full_state(model)
    if rank == 0:
        _write_ckpt(out / "roundtrip", back, back_opt)
        save_file({k: v.contiguous() for k, v in weights.items() if k != "lm_head.weight"}, str(out / "w2.st"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_full_finetune_checkpoints_move_between_one_and_two_ranks(tmp_path, tiny_model):
    """Full weights + AdamW states: 1 -> 2 (a one-process checkpoint sharded on load, gathered
    back bit-identical, trained on) and 2 -> 1 (a 2-rank checkpoint loaded by the plain
    one-process path), each against one process training straight through."""
    from services.trainer.checkpoint import optimizer_from_tensors, optimizer_to_tensors
    from services.trainer.policy import load_policy_files, policy_files

    set_threads(1)
    model, learner = _full_learner(tiny_model, shard=False)
    learner.train_batch(make_groups(GROUPS, G, seed=0))
    _write_ckpt(tmp_path / "one", policy_files(model, str(tiny_model)), optimizer_to_tensors(learner.opt))
    learner.train_batch(make_groups(GROUPS, G, seed=1))
    w1 = {k: v.detach().clone() for k, v in model.state_dict().items()}

    spawn_ranks(_full_worker, (free_port(), str(tmp_path), str(tiny_model)), "the FSDP ranks hung")

    # 1 -> 2 -> gathered: exactly what one process wrote (no arithmetic on the way).
    f1, o1, g1 = _read_ckpt(tmp_path / "one")
    fr, orr, gr = _read_ckpt(tmp_path / "roundtrip")
    assert f1.keys() == fr.keys() and o1.keys() == orr.keys() and g1 == gr
    for name in f1:
        if name.endswith(".safetensors"):
            a, b = load(f1[name]), load(fr[name])
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert all(torch.equal(o1[k], orr[k]) for k in o1)
    # 2 -> 1: the plain loader takes the 2-rank checkpoint; one more step lands where one process does.
    model, learner = _full_learner(tiny_model, shard=False)
    files, tensors, groups = _read_ckpt(tmp_path / "two")
    assert files.keys() == f1.keys() and tensors.keys() == o1.keys()
    load_policy_files(model, files)
    optimizer_from_tensors(learner.opt, tensors, groups)
    learner.sched.last_epoch = 1
    learner.train_batch(make_groups(GROUPS, G, seed=1))
    w3 = model.state_dict()
    w2 = load_file(str(tmp_path / "w2.st"))
    for k, v in w2.items():
        # AdamW (lr 1e-3) after a sharded step. Measured largest differences: 1.5e-8 (1 -> 2),
        # 4.8e-7 and, on another build of the tiny model, 2.2e-5 (2 -> 1: Adam's first steps
        # normalise each update, so an entry whose gradient is ~0 amplifies fp32 summation order
        # toward lr). A lost or misassigned optimizer state moves weights by ~lr: bound lr / 5.
        assert torch.allclose(v, w1[k], rtol=0, atol=2e-4), (k, float((v - w1[k]).abs().max()))
        assert torch.allclose(w3[k], w1[k], rtol=0, atol=2e-4), (k, float((w3[k] - w1[k]).abs().max()))


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"sharding": "fsdp", "cpu_offload": False, "world": 1, "device": "cpu"}, ["SHARDING=fsdp", "sharding=ddp"]),
        ({"sharding": "fsdp", "cpu_offload": False, "world": 1, "device": "cuda"}, ["WORLD_SIZE is 1", "torchrun"]),
        ({"sharding": "ddp", "cpu_offload": True, "world": 1, "device": "cpu"}, ["CPU_OFFLOAD", "cpu_offload=false"]),
        ({"sharding": "fsdp", "cpu_offload": True, "world": 2, "device": "cpu"}, ["needs a CUDA device"]),
        ({"sharding": "ddp", "cpu_offload": True, "world": 2, "device": "cuda"}, ["SHARDING=fsdp"]),
    ],
)
def test_settings_that_cannot_run_are_refused_naming_the_setting_and_the_fix(kw, names):
    with pytest.raises(ShardingError) as e:
        check_sharding(**kw)
    for n in names:
        assert n in str(e.value)


@pytest.mark.parametrize(
    "kw",
    [
        {"sharding": "ddp", "cpu_offload": False, "world": 1, "device": "cpu"},
        {"sharding": "ddp", "cpu_offload": False, "world": 2, "device": "cpu"},
        {"sharding": "fsdp", "cpu_offload": False, "world": 2, "device": "cpu"},
        {"sharding": "ddp", "cpu_offload": True, "world": 1, "device": "cuda"},  # offload only, one rank
        {"sharding": "fsdp", "cpu_offload": True, "world": 4, "device": "cuda:0"},
    ],
)
def test_settings_that_can_run_pass(kw):
    check_sharding(**kw)


def test_the_trainer_refuses_fsdp_on_one_process_at_start_up(tmp_path):
    """`python -m services.trainer` with sharding=fsdp and no torchrun: exits at once, naming it
    (before it touches Redis or the store: the URLs here lead nowhere)."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "BURSTRL_TRAINER_SHARDING": "fsdp",
        "BURSTRL_DEV": "1",
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "STORE_URL": f"file://{tmp_path}/store",
    }
    env.pop("WORLD_SIZE", None)
    p = subprocess.run(
        [sys.executable, "-m", "services.trainer"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode != 0
    assert "BURSTRL_TRAINER_SHARDING=fsdp needs torchrun" in p.stderr, p.stderr[-2000:]
    assert "use sharding=ddp" in p.stderr.lower()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offload_on_one_gpu_keeps_states_in_host_ram_and_trains(tmp_path, tiny_model):
    """cpu_offload on one CUDA card: FSDP2's CPUOffloadPolicy on a one-rank group. The weights
    and AdamW states live on the CPU, the step moves the adapter, and its files match an
    offload-free run of the same batch (bf16 on CUDA: a loose tolerance)."""
    from services.trainer.learner import Learner
    from services.trainer.policy import load_policy
    from services.trainer.sharding import full_trainable_state, gathered_policy_files, shard_model

    spec = JobSpec(base_model=str(tiny_model), group_size=G, batch_size=GROUPS, steps=1, learning_rate=1e-2)
    results = []
    for offload in (False, True):
        model, tok = load_policy(str(tiny_model), rank=8, alpha=16, device="cuda", seed=0)
        if offload:
            model = shard_model(model, device="cuda", cpu_offload=True)
        learner = Learner(model, spec, pad_id=tok.pad_token_id or 0, grad_clip=1.0, device="cuda")
        learner.train_batch(make_groups(GROUPS, G, seed=0))
        if offload:
            assert all(p.device.type == "cpu" for p in model.parameters())
            states = [t for st in learner.opt.state.values() for t in st.values() if torch.is_tensor(t)]
            assert states and all(t.device.type == "cpu" for t in states if t.dim() > 0)
            assert gathered_policy_files(model, str(tiny_model), main=True)
        results.append({k: v.float().cpu() for k, v in full_trainable_state(model).items()})
    a, b = results
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=5e-2, atol=5e-3), k
