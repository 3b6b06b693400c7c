"""The quantized memory savers (issue 22, item 3): 8-bit AdamW and an NF4 frozen base for LoRA.

Both are bitsandbytes (services/trainer/quant.py says why), whose CPU backend runs them here,
so these tests run on CPU; the CUDA variants are marked `gpu`. Tiny random Qwen2 models,
deterministic data, no wall-clock assertions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from services.trainer.checkpoint import (
    OPTIMIZER,
    TrainState,
    load_checkpoint,
    optimizer_from_tensors,
    save_checkpoint,
)
from services.trainer.learner import Learner
from services.trainer.optim import build_optimizer, check_resume, state_kind
from services.trainer.policy import load_policy, load_policy_files, policy_files
from services.trainer.quant import SaverUnavailable, check_base_bits, probe_nf4
from services.trainer.settings import TrainerSettings
from shared.job import JobSpec
from shared.schema import GroupMsg
from shared.store import FileStore
from tests.support import ROOT
from tests.support.trainer_groups import random_groups

REPO = ROOT
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 64: every linear has >= 4096 weights, so bitsandbytes keeps 8-bit states for them
    # (tensors under its min_8bit_size of 4096 elements keep fp32 states).
    from shared.ml.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, seed=0)


def _groups(seed: int = 3) -> list[GroupMsg]:
    return random_groups(seed=seed, tokens=6, tag=f"{seed}-")


def _spec(model_dir: Path, finetune: str = "full") -> JobSpec:
    return JobSpec(
        base_model=str(model_dir),
        group_size=2,
        batch_size=2,
        steps=4,
        learning_rate=3e-3,
        lora_rank=64,  # 64 x 64 factors: 4096 weights each, so LoRA's states are 8-bit too
        lora_alpha=64,
        algorithm={"finetune": finetune},
    )


def _sft_losses(model_dir: Path, kind: str, steps: int = 20) -> list[float]:
    """Full fine-tuning of the tiny model on one fixed batch with next-token cross-entropy."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(3, 200, (8, 24), generator=torch.Generator().manual_seed(0))
    opt = build_optimizer(model.parameters(), kind, lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if kind == "adamw8bit":
        big = [p for p in model.parameters() if p.numel() >= 4096]
        assert big and all(opt.state[p]["state1"].dtype == torch.uint8 for p in big), "states are not 8-bit"
    return losses


# -- 8-bit AdamW ------------------------------------------------------------------------


def test_adamw8bit_trains_like_fp32_adamw(model_dir: Path) -> None:
    ref, q = _sft_losses(model_dir, "adamw"), _sft_losses(model_dir, "adamw8bit")
    # Measured on this model: both go 5.578 -> 2.06 in 20 steps and differ by about 1e-3.
    # A drop of 2 nats is far past noise; 0.05 nats bounds the 8-bit moments' error.
    assert ref[0] - ref[-1] > 2.0 and q[0] - q[-1] > 2.0, (ref, q)
    assert abs(q[-1] - ref[-1]) < 0.05, (ref[-1], q[-1])


def test_adamw8bit_learner_state_round_trips_through_a_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    """Two GRPO steps, a checkpoint in the store (safetensors), a fresh trainer from it: the next
    step is bit-identical to the one the uninterrupted learner takes."""
    spec = _spec(model_dir)

    def learner() -> Learner:
        model, tok = load_policy(str(model_dir), rank=64, alpha=64, device="cpu", seed=0, finetune="full")
        return Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0, optimizer="adamw8bit")

    a = learner()
    for seed in (1, 2):
        a.train_batch(_groups(seed=seed))
    store = FileStore(tmp_path / "store")
    save_checkpoint(store, "j", TrainState(step=2), policy_files(a.model, str(model_dir)), a.opt, a.sched)

    ck = load_checkpoint(store, "j", 2)
    raw = load(get_file(store, "j", 2, OPTIMIZER))  # safetensors: a pickle would not parse here
    assert any(v.dtype == torch.uint8 for v in raw.values())
    assert state_kind(ck.opt_tensors) == "adamw8bit"
    b = learner()
    load_policy_files(b.model, ck.files)
    check_resume("adamw8bit", ck.opt_tensors)
    optimizer_from_tensors(b.opt, ck.opt_tensors, ck.param_groups)
    b.sched.load_state_dict(ck.scheduler)
    assert all(isinstance(st["step"], int) for st in b.opt.state.values())  # bitsandbytes' int, not a tensor

    for lrn in (a, b):
        lrn.train_batch(_groups(seed=3))
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def get_file(store: FileStore, job: str, step: int, name: str) -> bytes:
    from services.trainer.checkpoint import ckpt_prefix
    from shared.folders import folder_file

    return store.get(folder_file(store, ckpt_prefix(job, step), name))


def test_resuming_with_the_other_optimizer_is_refused(model_dir: Path) -> None:
    model, tok = load_policy(str(model_dir), rank=64, alpha=64, device="cpu", seed=0, finetune="full")
    lrn = Learner(model, _spec(model_dir), pad_id=tok.pad_token_id, grad_clip=1.0, optimizer="adamw")
    lrn.train_batch(_groups())
    from services.trainer.checkpoint import optimizer_to_tensors

    tensors, _ = optimizer_to_tensors(lrn.opt)
    assert state_kind(tensors) == "adamw"
    check_resume("adamw", tensors)
    with pytest.raises(ValueError, match=r"optimizer=adamw8bit.*BURSTRL_TRAINER_OPTIMIZER=adamw\b"):
        check_resume("adamw8bit", tensors)


# -- NF4 base ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_nf4_base_lora_trains_and_publishes_a_plain_adapter(model_dir: Path, device: str) -> None:
    import bitsandbytes as bnb

    probe_nf4(device)  # this bitsandbytes has NF4 kernels for the device (else the test is wrong here)
    q, tok = load_policy(str(model_dir), rank=8, alpha=16, device=device, seed=0, base_bits=4)
    ref, _ = load_policy(str(model_dir), rank=8, alpha=16, device=device, seed=0)
    linears = [m for m in q.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7  # every decoder linear; lm_head (tied to the embeddings) stays 16/32-bit
    assert all(m.weight.dtype == torch.uint8 and m.weight.quant_type == "nf4" for m in linears)
    assert all(not p.requires_grad for n, p in q.named_parameters() if "lora_" not in n)

    # The NF4 base is an approximation of the 16-bit one: close log-probs, not equal ones.
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        lq = torch.log_softmax(q(input_ids=ids).logits.float(), -1)
        lr = torch.log_softmax(ref(input_ids=ids).logits.float(), -1)
    assert 0 < float((lq - lr).abs().mean()) < 0.1

    # The trainer's probe is exactly that eval-mode no-grad forward; training must still work after it.
    from services.trainer.probe import compute_probe

    compute_probe(q, tok, "arith")
    before = {n: p.detach().clone() for n, p in q.named_parameters() if p.requires_grad}
    lrn = Learner(q, _spec(model_dir, "lora"), pad_id=tok.pad_token_id, grad_clip=1.0, device=device)
    res = lrn.train_batch(_groups())
    assert res.updates == 1 and torch.isfinite(torch.tensor(res.grad_norm)) and res.grad_norm > 0
    moved = [n for n, p in q.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in moved)
    # The published adapter is plain LoRA: it loads into a 16-bit base as vLLM and peft load it.
    files = policy_files(q, str(model_dir))
    load_policy_files(ref, files)
    assert all(v.dtype == torch.float32 for v in load(files["adapter_model.safetensors"]).values())


def test_nf4_base_with_adamw8bit_together(model_dir: Path) -> None:
    """QLoRA's usual pairing: a 4-bit base and 8-bit states for the (rank-64) adapter."""
    q, tok = load_policy(str(model_dir), rank=64, alpha=64, device="cpu", seed=0, base_bits=4)
    lrn = Learner(q, _spec(model_dir, "lora"), pad_id=tok.pad_token_id, grad_clip=1.0, optimizer="adamw8bit")
    res = lrn.train_batch(_groups())
    assert res.updates == 1 and res.grad_norm > 0
    # Factors of 4096+ weights (all but k/v's 32 x 64 lora_B) get 8-bit states, the rest fp32.
    states = {p.numel(): lrn.opt.state[p]["state1"].dtype for p in lrn.params}
    assert states[64 * 64] == torch.uint8 and states[32 * 64] == torch.float32, states


# -- bad input: refuse at start-up, never fall back -------------------------------------


def test_a_4bit_base_under_full_fine_tuning_is_refused(model_dir: Path) -> None:
    with pytest.raises(SaverUnavailable, match=r"base_bits=4.*finetune='full'.*BURSTRL_TRAINER_BASE_BITS=16"):
        check_base_bits(4, "full")
    with pytest.raises(SaverUnavailable, match="base_bits=4"):
        load_policy(str(model_dir), rank=8, alpha=16, device="cpu", seed=0, finetune="full", base_bits=4)


def test_a_device_without_kernels_is_refused_naming_the_setting() -> None:
    # "meta" stands for a device bitsandbytes has no backend for (as CPUs were before 0.46). In a
    # subprocess: bitsandbytes caches per-device lookup tables, and a meta one must not leak here.
    code = """
from services.trainer.quant import SaverUnavailable, probe_adamw8bit, probe_nf4
for probe in (probe_nf4, probe_adamw8bit):
    try:
        probe("meta")
    except SaverUnavailable as e:
        print("REFUSED", e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.splitlines()
    refused = [line for line in out if line.startswith("REFUSED")]
    assert len(refused) == 2, out
    assert re.search(r"base_bits=4.*'meta'.*BURSTRL_TRAINER_BASE_BITS=16", refused[0]), refused[0]
    assert re.search(r"optimizer=adamw8bit.*'meta'.*BURSTRL_TRAINER_OPTIMIZER=adamw", refused[1]), refused[1]


def test_the_quantized_savers_are_refused_under_fsdp_or_offload() -> None:
    from services.trainer.quant import check_savers

    for other in ({"sharding": "fsdp"}, {"cpu_offload": True}):
        with pytest.raises(SaverUnavailable, match=r"base_bits=4 cannot be combined.*BASE_BITS=16"):
            check_savers(TrainerSettings(dev=True, base_bits=4, **other), "cpu")
        with pytest.raises(SaverUnavailable, match=r"optimizer=adamw8bit cannot be combined.*OPTIMIZER=adamw"):
            check_savers(TrainerSettings(dev=True, optimizer="adamw8bit", **other), "cpu")
    check_savers(TrainerSettings(dev=True, base_bits=4, optimizer="adamw8bit"), "cpu")  # ddp, no offload: fine


def test_without_bitsandbytes_each_saver_names_the_install_and_the_alternative(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # an import of it now raises ImportError
    with pytest.raises(SaverUnavailable, match=r"base_bits=4 needs bitsandbytes.*BURSTRL_TRAINER_BASE_BITS=16"):
        probe_nf4("cpu")
    with pytest.raises(SaverUnavailable, match=r"optimizer=adamw8bit needs bitsandbytes.*OPTIMIZER=adamw"):
        build_optimizer([torch.nn.Parameter(torch.ones(3))], "adamw8bit", lr=1e-3)


def test_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("BURSTRL_TRAINER_BASE_BITS", "8")
    with pytest.raises(ValidationError, match="base_bits"):
        TrainerSettings()
    monkeypatch.setenv("BURSTRL_TRAINER_BASE_BITS", "4")
    monkeypatch.setenv("BURSTRL_TRAINER_OPTIMIZER", "adam8")
    with pytest.raises(ValidationError, match="optimizer"):
        TrainerSettings()


def test_the_trainer_process_refuses_to_start_with_a_saver_its_device_cannot_run(tmp_path: Path) -> None:
    """A real `python -m services.trainer`: it exits at start-up with the message, before it
    opens the store or claims a job (no Redis is running for it; the port is never reached)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "BURSTRL_DEV": "1",
        "BURSTRL_TRAINER_DEVICE": "meta",
        "BURSTRL_TRAINER_BASE_BITS": "4",
        "BURSTRL_REDIS_URL": "redis://127.0.0.1:1/0",
        "BURSTRL_STORE_URL": f"file://{tmp_path}/store",
    }
    out = subprocess.run(
        [sys.executable, "-m", "services.trainer"], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode != 0
    assert "trainer: base_bits=4" in out.stderr and "BURSTRL_TRAINER_BASE_BITS=16" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "store").exists()


# -- the planner's numbers for these savers ---------------------------------------------


def test_planner_estimate_matches_measured_steps_with_each_saver() -> None:
    """bench/plan_calibration.py's CPU measurement (fresh subprocess) against the planner, for the
    8-bit optimizer and the NF4 base, within the 5% docs/plan.md states (tests/integration/test_plan.py)."""
    from tests.support.calibration import calibrate

    for case in [
        {"config": "tiny", "method": "full", "optimizer": "adamw8bit"},
        {"config": "tiny", "method": "lora", "base_bits": 4},
    ]:
        estimate, measured = calibrate(case)
        assert estimate == pytest.approx(measured, rel=0.05), case


# -- through the trainer loop (real Redis, file store) ----------------------------------


def test_a_job_with_both_savers_crashes_and_resumes_to_the_uninterrupted_weights(
    r, tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings reach the trainer (NF4 base, bitsandbytes' AdamW; test_trainer_resume's job, whose
    rank-4 factors are small enough that bitsandbytes keeps their states fp32), a crash after step 3
    resumes from the step-2 checkpoint to the same weights as an uninterrupted run, and resuming it
    with the other optimizer is refused naming the setting."""
    import bitsandbytes as bnb

    from tests.support.trainer_resume import Run, crash_before_publish

    def run_with_savers(where: Path) -> Run:
        run = Run(r, where, model_dir, checkpoint_every=2)
        run.settings = run.settings.model_copy(update={"optimizer": "adamw8bit", "base_bits": 4})
        return run

    ref = run_with_savers(tmp_path / "ref")
    t = ref.trainer()
    assert isinstance(t.learner.opt, bnb.optim.AdamW8bit)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in t.model.modules())
    t.run()
    want = ref.final()

    run = run_with_savers(tmp_path / "crash")
    crash_before_publish(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="injected"):
        run.trainer().run()
    monkeypatch.undo()

    run.settings = run.settings.model_copy(update={"optimizer": "adamw"})
    with pytest.raises(ValueError, match=r"optimizer=adamw, but the checkpoint's optimizer state was written by"):
        run.trainer()
    run.settings = run.settings.model_copy(update={"optimizer": "adamw8bit"})
    t = run.trainer()
    assert t.state.step == 2
    t.run()
    got = run.final()
    assert got[0].keys() == want[0].keys()
    for k in got[0]:
        assert torch.equal(got[0][k], want[0][k]), k
    assert got[1] == pytest.approx(want[1])
