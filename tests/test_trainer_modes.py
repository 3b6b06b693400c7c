"""Training modes on a tiny random model: LoRA vs full fine-tuning, gradient checkpointing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.learner import Learner
from services.trainer.policy import is_lora, load_policy, load_policy_files, policy_files
from shared.job import JobSpec
from shared.schema import Completion, GroupMsg, pack_f32, pack_i32, pack_u8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.trainer.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, seed=0)


def _groups(n: int = 2, g: int = 2) -> list[GroupMsg]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        comps = [
            Completion(
                token_ids=pack_i32(torch.randint(3, 200, (4,), generator=gen).tolist()),
                logprobs=pack_f32((-torch.rand(4, generator=gen) * 3).tolist()),
                loss_mask=pack_u8([1, 1, 1, 1]),
                text="x",
                finish_reason="stop",
                reward=float(j),
            )
            for j in range(g)
        ]
        out.append(
            GroupMsg(
                job_id="j",
                group_id=f"g{i}",
                item_id=str(i),
                prompt="p",
                prompt_ids=pack_i32([5, 6, 7]),
                policy_version=0,
                completions=comps,
                stage="ready",
            )
        )
    return out


def _spec(model_dir: Path, **algorithm) -> JobSpec:  # noqa: ANN003
    return JobSpec(base_model=str(model_dir), group_size=2, batch_size=2, steps=3, algorithm=algorithm)


def test_full_finetune_trains_every_weight_and_roundtrips_its_files(model_dir):
    spec = _spec(model_dir, finetune="full")
    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0, finetune="full")
    assert not is_lora(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(_groups())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("layers.0.mlp" in k for k in changed)  # the base weights move, not just an adapter
    files = policy_files(model, str(model_dir))
    assert "config.json" in files and any(n.endswith(".safetensors") for n in files)
    fresh, _ = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0, finetune="full")
    load_policy_files(fresh, files)
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k


def test_gradient_checkpointing_gives_the_same_step(model_dir):
    out = []
    for gc in (False, True):
        model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0, gradient_checkpointing=gc)
        res = Learner(model, _spec(model_dir), pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(_groups())
        out.append((res.stats["loss"], res.grad_norm))
    assert out[0] == pytest.approx(out[1], rel=1e-5)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"advantage": "rloo", "aggregation": "seq-mean-token-sum", "kl_estimator": "k2"},
        {"advantage": "dr_grpo", "aggregation": "seq-mean-token-sum-norm", "mismatch": "sequence_mask"},
        {"ratio_level": "sequence", "ppo_epochs": 2, "minibatches": 2, "mismatch": "token_mask"},
        {"kl_in": "reward", "entropy_coef": 0.01, "mismatch": "none"},
    ],
)
def test_algorithm_variants_run_end_to_end(model_dir, algorithm):  # noqa: ANN001
    spec = JobSpec(base_model=str(model_dir), group_size=2, batch_size=2, steps=3, kl_coef=0.1, algorithm=algorithm)
    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0)
    groups = _groups()
    for g in groups:  # the ref stage's log-probs, for the KL term
        for c in g.completions:
            c.ref_logprobs = pack_f32([-1.0] * 4)
    res = Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(groups)
    assert res.updates == spec.algorithm.ppo_epochs * spec.algorithm.minibatches
    assert all(v == v for v in res.stats.values())  # no NaN
    assert "kl_ref" in res.stats and "mismatch_kl" in res.stats
