"""Training modes on a tiny random model: LoRA vs full fine-tuning, gradient checkpointing,
micro-batches, and the loss family (CISPO, SAPO, DPPO-TV, IcePop, Geo-RS, M2PO, REINFORCE++)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.trainer.learner import Learner
from services.trainer.policy import is_lora, load_policy, load_policy_files, policy_files
from shared.job import JobSpec
from shared.schema import Completion, GroupMsg, pack_f32, pack_i32, pack_u8, unpack_f32
from tests.support.trainer_groups import near_policy, random_groups, ready_group


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shared.ml.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, seed=0)


def _spec(model_dir: Path, **algorithm) -> JobSpec:  # noqa: ANN003
    return JobSpec(base_model=str(model_dir), group_size=2, batch_size=2, steps=3, algorithm=algorithm)


def test_full_finetune_trains_every_weight_and_roundtrips_its_files(model_dir):
    spec = _spec(model_dir, finetune="full")
    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0, finetune="full")
    assert not is_lora(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(random_groups())
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
        res = Learner(model, _spec(model_dir), pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(random_groups())
        out.append((res.stats["loss"], res.grad_norm))
    assert out[0] == pytest.approx(out[1], rel=1e-5)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"advantage": "rloo", "aggregation": "seq-mean-token-sum", "kl_estimator": "k2"},
        {"advantage": "dr_grpo", "aggregation": "seq-mean-token-sum-norm", "mismatch": "sequence_mask"},
        {"ratio_level": "sequence", "ppo_epochs": 2, "minibatches": 2, "mismatch": "token_mask"},
        {"kl_in": "reward", "entropy_coef": 0.01, "mismatch": "none"},
        {"loss": "cispo", "ppo_epochs": 2, "mismatch": "icepop", "advantage": "reinforce_plus_plus"},
        {
            "loss": "sapo",
            "ratio_level": "sequence",
            "mismatch": "geo_mask",
            "advantage": "reinforce_plus_plus_baseline",
        },
        {"loss": "dppo_tv", "mismatch": "none", "minibatches": 2},
        {"mismatch": "m2po", "ppo_epochs": 2, "minibatches": 2},
    ],
)
def test_algorithm_variants_run_end_to_end(model_dir, algorithm):  # noqa: ANN001
    spec = JobSpec(base_model=str(model_dir), group_size=2, batch_size=2, steps=3, kl_coef=0.1, algorithm=algorithm)
    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0)
    groups = random_groups()
    for g in groups:  # the ref stage's log-probs, for the KL term
        for c in g.completions:
            c.ref_logprobs = pack_f32([-1.0] * 4)
    res = Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(groups)
    assert res.updates == spec.algorithm.ppo_epochs * spec.algorithm.minibatches
    assert all(math.isfinite(v) for v in res.stats.values())
    assert {"kl_ref", "mismatch_kl", "m2", "mask_frac", "clip_frac", "ess", "ess_raw"} <= res.stats.keys()


def _uneven_groups(n: int = 3, g: int = 4) -> list[GroupMsg]:
    """Completions of 1..12 tokens with partial loss masks and ref log-probs: padding matters."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        comps = []
        for j in range(g):
            t = int(torch.randint(1, 13, (1,), generator=gen))
            mask = [1] * t
            if t > 3:
                mask[1] = 0  # an observation token inside the completion
            comps.append(
                Completion(
                    token_ids=pack_i32(torch.randint(3, 200, (t,), generator=gen).tolist()),
                    logprobs=pack_f32((-torch.rand(t, generator=gen) * 3).tolist()),
                    ref_logprobs=pack_f32((-torch.rand(t, generator=gen) * 3).tolist()),
                    loss_mask=pack_u8(mask),
                    text="x",
                    finish_reason="stop",
                    reward=float((i + j) % 3),
                )
            )
        out.append(ready_group(i, comps, [5, 6, 7][: 1 + i % 3]))
    return out


@pytest.mark.parametrize(
    "algorithm",
    [
        {},
        {"aggregation": "seq-mean-token-mean", "entropy_coef": 0.01},
        {"ratio_level": "sequence", "ppo_epochs": 2, "minibatches": 3, "advantage": "rloo"},
        {"aggregation": "seq-mean-token-sum-norm", "advantage": "dr_grpo", "kl_in": "reward"},
    ],
)
def test_micro_batches_give_the_same_update(model_dir, algorithm):  # noqa: ANN001
    """Passes sorted by length with a token budget accumulate exactly one pass's gradient."""
    _same_update_in_micro_batches(model_dir, algorithm, _uneven_groups())


@pytest.mark.parametrize(
    ("algorithm", "acts"),
    [
        ({"mismatch": "m2po"}, "mask_frac"),  # one pass: the cutoff from that pass; 24 tokens: gathered
        ({"mismatch": "m2po", "loss": "cispo", "ppo_epochs": 2, "minibatches": 3}, "mask_frac"),
        ({"mismatch": "icepop", "loss": "sapo", "ratio_level": "sequence", "ppo_epochs": 2}, "mask_frac"),
        ({"mismatch": "geo_mask", "geo_low": 0.8, "geo_high": 1.25, "advantage": "reinforce_plus_plus"}, "mask_frac"),
        ({"loss": "dppo_tv", "mismatch": "none", "dppo_low": 0.002, "dppo_high": 0.002}, "clip_frac"),
        (
            {"loss": "cispo", "cispo_max": 1.001, "ppo_epochs": 2, "advantage": "reinforce_plus_plus_baseline"},
            "clip_frac",
        ),
    ],
)
def test_micro_batches_give_the_same_update_for_the_loss_family(model_dir, algorithm, acts):  # noqa: ANN001
    groups = near_policy(_uneven_groups(), model_dir, noise=0.5)
    one = _same_update_in_micro_batches(model_dir, algorithm, groups, sgd=True)
    assert 0.0 < one.stats[acts] < 1.0, one.stats  # the mask or trust region acted, on some tokens only


def _same_update_in_micro_batches(
    model_dir: Path, algorithm: dict, groups: list[GroupMsg], *, sgd: bool = False
) -> object:
    """One pass vs passes of <= 24 padded tokens: the same stats, gradient norm and weights.

    sgd: plain SGD instead of Adam, as tests/integration/test_trainer_ddp.py does: Adam divides by sqrt(v)
    and turns float-order noise in near-zero gradients into lr-sized differences, while SGD
    weights are linear in the gradients (capped or masked tokens make such gradients common)."""
    spec = JobSpec(base_model=str(model_dir), group_size=4, batch_size=3, steps=3, kl_coef=0.05, algorithm=algorithm)
    out = []
    for budget in (0, 24):
        model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0)
        learner = Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0, micro_batch_tokens=budget)
        if sgd:
            learner.opt = torch.optim.SGD(learner.params, lr=0.5)
            learner.sched = torch.optim.lr_scheduler.LambdaLR(learner.opt, lambda _: 1.0)
        res = learner.train_batch(groups)
        weights = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
        out.append((res, weights))
    (one, w1), (many, w2) = out
    assert one.updates == many.updates == spec.algorithm.ppo_epochs * spec.algorithm.minibatches
    assert many.grad_norm == pytest.approx(one.grad_norm, rel=1e-4, abs=1e-7)
    for k, v in one.stats.items():
        assert many.stats[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)
    return one


def test_micro_batch_passes_cover_each_row_once_within_the_budget(model_dir):
    from services.trainer.batch import collate

    spec = JobSpec(base_model=str(model_dir), group_size=4, batch_size=3, steps=3)
    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0)
    b = collate(_uneven_groups(), tok.pad_token_id)
    lengths = b.attention_mask.sum(dim=1).tolist()
    rows = list(range(len(lengths)))
    for budget in (1, 16, 24, 10_000):
        passes = Learner(model, spec, pad_id=0, grad_clip=1.0, micro_batch_tokens=budget)._chunks(lengths, rows)
        assert sorted(r for p in passes for r in p) == rows
        for p in passes:
            assert len(p) == 1 or len(p) * max(lengths[r] for r in p) <= budget
        flat = [lengths[r] for p in passes for r in p]
        assert flat == sorted(flat, reverse=True)  # longest first: a pass pads to its first row
    assert Learner(model, spec, pad_id=0, grad_clip=1.0, micro_batch_tokens=0)._chunks(lengths, rows) == [rows]
    assert len(Learner(model, spec, pad_id=0, grad_clip=1.0, micro_batch_tokens=10_000)._chunks(lengths, rows)) == 1


def _seq_logp(model: torch.nn.Module, groups: list[GroupMsg], pad_id: int) -> torch.Tensor:
    """Each completion's summed log-prob under `model` ([N]), trained tokens only."""
    from services.trainer.batch import collate
    from shared.ml.logprobs import token_logprobs

    b = collate(groups, pad_id)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
    return (token_logprobs(logits, b.input_ids[:, 1:]) * b.mask).sum(-1)


def test_m2po_learns_from_a_stale_sampler_and_masks_only_its_outliers(model_dir):
    """A sampler close to the trainer (noise 0.05 nats) except on every 8th token, where it is
    2 nats off either way (a stale version's outliers). Squared log-ratios: ~0.0025 on most tokens, 4 on the
    outliers; M2PO (tau 0.04) must mask exactly the outliers, since keeping even one would put
    the batch's M2 above 0.04 (4 / 60 > 0.04 with ~60 kept tokens), and the rest must still
    teach: the rewarded completions' log-prob rises against the others'."""
    gen = torch.Generator().manual_seed(5)
    groups = [
        ready_group(
            i,
            [
                Completion(
                    token_ids=pack_i32(torch.randint(3, 200, (6,), generator=gen).tolist()),
                    logprobs=pack_f32([0.0] * 6),
                    loss_mask=pack_u8([1] * 6),
                    text="x",
                    finish_reason="stop",
                    reward=1.0 if j == 0 else 0.0,
                )
                for j in range(4)
            ],
            [5, 6, 7],
        )
        for i in range(3)
    ]
    groups = near_policy(groups, model_dir, noise=0.05)
    comps = [c for g in groups for c in g.completions]
    n_out = 0
    for i, c in enumerate(comps):
        lp = torch.tensor(unpack_f32(c.logprobs))
        for t in range(6):
            if (i * 6 + t) % 8 == 0:
                lp[t] += 2.0 if n_out % 2 else -2.0  # ratio trainer/sampler e^2 or e^-2
                n_out += 1
        c.logprobs = pack_f32(lp.tolist())
    spec = JobSpec(base_model=str(model_dir), group_size=4, batch_size=3, steps=5, algorithm={"mismatch": "m2po"})
    model, tok = load_policy(str(model_dir), rank=4, alpha=8, device="cpu", seed=0)
    learner = Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0)
    rewarded = torch.tensor([c.reward for c in comps]) > 0

    def gap() -> float:
        lp = _seq_logp(model, groups, tok.pad_token_id)
        return float(lp[rewarded].mean() - lp[~rewarded].mean())

    before = gap()
    steps = [learner.train_batch(groups).stats for _ in range(5)]
    after = gap()
    first = steps[0]
    assert first["mask_frac"] == pytest.approx(n_out / len(rewarded) / 6)  # the outliers, and only them
    assert first["m2"] == pytest.approx(
        (4.0 * n_out + 0.0025 * (6 * len(rewarded) - n_out)) / (6 * len(rewarded)), rel=0.1
    )
    # The kept weights are ~1, so the ESS is the kept share; the raw ratios' (e^2 outliers) is lower.
    assert first["ess"] == pytest.approx(1.0 - first["mask_frac"], abs=0.01) and first["ess_raw"] < first["ess"]
    for st in steps:
        assert all(math.isfinite(v) for v in st.values())
    print(f"gap before {before:.4f} after {after:.4f}; first step {first}")
    assert after - before > 0.5, (before, after)
