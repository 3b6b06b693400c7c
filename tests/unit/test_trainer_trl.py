"""Cross-check: our loss and its gradient equal TRL's GRPOTrainer._compute_loss on identical inputs.

TRL's loss is a method of GRPOTrainer that reads its configuration from `self`; we call it
unbound with a stand-in `self` whose `_get_per_token_logps_and_entropies` returns our
log-prob tensor (a leaf with a gradient). Everything after that line of TRL runs as
shipped: PPO clip, CISPO, SAPO, vLLM importance-sampling weight, k3 KL, aggregation per
loss_type, entropy bonus. TRL's vLLM IS ratio is built the way its
_generate_and_score_completions builds it (exp(old - sampler), clamped or masked to
[clip_min, clip_max]), since that part runs at generation time; a guard test checks that
TRL's source still builds it that way.
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from services.trainer.losses import LossConfig, policy_loss  # noqa: E402

N, T = 6, 5


class _Accel:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):  # noqa: ANN001, ANN201
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):  # noqa: ANN001, ANN201
        return x


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, T, generator=g) * 3  # trainer log-probs
    old = logp + 0.3 * torch.randn(N, T, generator=g)  # a later mini-batch: the ratio moved, clipping acts
    sampler = old + 0.5 * torch.randn(N, T, generator=g)  # vLLM's, off by quantization/staleness
    ref = logp + 0.2 * torch.randn(N, T, generator=g)
    mask = torch.ones(N, T)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    mask[4, 4:] = 0
    adv = torch.randn(N, generator=g)
    entropy = torch.rand(N, T, generator=g) * 2
    return logp, old, sampler, ref, mask, adv, entropy


def _trl_is_ratio(old, sampler, mask, mode: str, cap: float, floor: float | None):  # noqa: ANN001, ANN202
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=floor, max=cap)
    return r.masked_fill((r < (-math.inf if floor is None else floor)) | (r > cap), 0.0)


def test_trl_still_builds_its_is_ratio_as_the_stand_in_does():
    """_trl_is_ratio copies inline code of TRL's generation step; fail loudly if TRL changes it."""
    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for line in (
        "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
        "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
        "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
        "min=self.vllm_importance_sampling_clip_min",
        "max=self.vllm_importance_sampling_clip_max",
        "invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (",
    ):
        assert line in src, line


def _trl_loss(  # noqa: ANN202, PLR0913
    loss_type,
    level,
    beta,
    entropy_coef,
    mode,
    cap,
    logp_leaf,
    old,
    sampler,
    ref,
    mask,
    adv,
    ent,
    **kw,  # noqa: ANN001, ANN003
):
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_leaf, ent, None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=kw.get("epsilon_high", 0.28),
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=_Accel(),
        _entropy_bonus_enabled=entropy_coef > 0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        max_completion_length=T,
        args=SimpleNamespace(
            use_bias_correction_kl=False,
            delta=None,
            steps_per_generation=1,
            sapo_temperature_pos=kw.get("tau_pos", 1.0),
            sapo_temperature_neg=kw.get("tau_neg", 1.05),
        ),
    )
    inputs = {
        "prompt_ids": torch.zeros(N, 1, dtype=torch.long),
        "prompt_mask": torch.ones(N, 1, dtype=torch.long),
        "completion_ids": torch.zeros(N, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "importance_sampling_ratio": _trl_is_ratio(old, sampler, mask, mode, cap, kw.get("floor")),
        "num_items_in_batch": mask.sum(),
    }
    return GRPOTrainer._compute_loss(fake, None, inputs)


CASES = [
    # (TRL loss_type, TRL IS level, our aggregation, mismatch mode, beta, entropy_coef)
    ("grpo", "token", "seq-mean-token-mean", "token_truncate", 0.04, 0.0),
    ("dapo", "token", "token-mean", "token_truncate", 0.0, 0.0),
    ("dapo", "token", "token-mean", "token_mask", 0.1, 0.01),
    ("bnpo", "token", "token-mean", "sequence_truncate", 0.0, 0.0),
    ("dr_grpo", "token", "seq-mean-token-sum-norm", "sequence_mask", 0.04, 0.0),
    ("grpo", "sequence", "seq-mean-token-mean", "token_truncate", 0.0, 0.0),  # GSPO
]


@pytest.mark.parametrize(("loss_type", "level", "aggregation", "mode", "beta", "ent_coef"), CASES)
def test_loss_and_gradient_match_trl(loss_type, level, aggregation, mode, beta, ent_coef):  # noqa: ANN001
    logp, old, sampler, ref, mask, adv, ent = _inputs(zlib.crc32(f"{loss_type}{level}{mode}".encode()) % 1000)
    cap = 2.0 if "truncate" in mode else 3.0
    theirs_leaf = logp.clone().requires_grad_(True)
    theirs = _trl_loss(loss_type, level, beta, ent_coef, mode, cap, theirs_leaf, old, sampler, ref, mask, adv, ent)
    theirs.backward()

    ours_leaf = logp.clone().requires_grad_(True)
    cfg = LossConfig(
        clip_low=0.2,
        clip_high=0.28,
        ratio_level=level,
        aggregation=aggregation,
        max_tokens=T,
        mismatch=mode,
        tis_cap=cap,
        kl_coef=beta,
        kl_estimator="k3",
        entropy_coef=ent_coef,
    )
    ours, _ = policy_loss(ours_leaf, old, adv, mask, cfg, sampler_logp=sampler, ref_logp=ref, entropy=ent)
    ours.backward()

    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(ours_leaf.grad, theirs_leaf.grad, rtol=1e-5, atol=1e-7)
    assert theirs_leaf.grad.abs().sum() > 0  # the comparison is not vacuous


# TRL's clip_min with its token / sequence modes against burstrl's mismatch_min, and IcePop
# (TRL token_mask with both bounds: burstrl's mismatch = "icepop").
IS_CASES = [
    # (our mismatch, TRL's vllm_importance_sampling_mode, clip_min, clip_max)
    ("token_truncate", "token_truncate", 0.7, 1.5),
    ("token_mask", "token_mask", 0.6, 2.0),
    ("sequence_truncate", "sequence_truncate", 0.5, 3.0),
    ("sequence_mask", "sequence_mask", 0.3, 3.0),
    ("icepop", "token_mask", 0.5, 2.0),
]


def _ours(logp, old, sampler, ref, mask, adv, ent, **cfg):  # noqa: ANN001, ANN003, ANN202
    leaf = logp.clone().requires_grad_(True)
    base = {"clip_low": 0.2, "clip_high": 0.28, "max_tokens": T, "kl_estimator": "k3"}
    loss, stats = policy_loss(
        leaf, old, adv, mask, LossConfig(**{**base, **cfg}), sampler_logp=sampler, ref_logp=ref, entropy=ent
    )
    loss.backward()
    return loss, leaf.grad, stats


def _theirs(loss_type, level, beta, mode, cap, logp, old, sampler, ref, mask, adv, ent, **kw):  # noqa: ANN001, ANN003, ANN202
    leaf = logp.clone().requires_grad_(True)
    loss = _trl_loss(loss_type, level, beta, 0.0, mode, cap, leaf, old, sampler, ref, mask, adv, ent, **kw)
    loss.backward()
    return loss, leaf.grad


def _same(ours, theirs) -> None:  # noqa: ANN001
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-7)
    assert theirs[1].abs().sum() > 0  # the comparison is not vacuous


@pytest.mark.parametrize(("ours_mode", "trl_mode", "floor", "cap"), IS_CASES)
def test_is_modes_with_both_bounds_match_trl(ours_mode, trl_mode, floor, cap):  # noqa: ANN001
    x = _inputs(zlib.crc32(f"{ours_mode}{floor}".encode()) % 1000)
    theirs = _theirs("dapo", "token", 0.04, trl_mode, cap, *x, floor=floor)
    if ours_mode == "icepop":
        cfg = {"mismatch": "icepop", "icepop_low": floor, "icepop_high": cap}
    else:
        cfg = {"mismatch": ours_mode, "mismatch_min": floor, "tis_cap": cap}
    ours = _ours(*x, aggregation="token-mean", kl_coef=0.04, **cfg)
    _same(ours, theirs)
    assert ours[2]["is_frac"] > 0  # some weights hit a bound


@pytest.mark.parametrize(("mode", "w_max"), [("token_truncate", 1.2), ("token_mask", 5.0), ("sequence_mask", 1.2)])
def test_cispo_matches_trl(mode, w_max):  # noqa: ANN001
    """TRL's cispo: -clamp(r, max=epsilon_high).detach() * A * logp, summed over the batch's tokens."""
    x = _inputs(zlib.crc32(f"cispo{mode}{w_max}".encode()) % 1000)
    theirs = _theirs("cispo", "token", 0.04, mode, 3.0, *x, epsilon_high=w_max)
    ours = _ours(*x, loss="cispo", cispo_max=w_max, aggregation="token-mean", mismatch=mode, tis_cap=3.0, kl_coef=0.04)
    _same(ours, theirs)
    if w_max < 2:
        assert ours[2]["clip_high_frac"] > 0  # the cap acted


@pytest.mark.parametrize(
    ("level", "mode", "tau_pos", "tau_neg"),
    [
        ("token", "token_truncate", 1.0, 1.05),
        ("token", "sequence_mask", 0.5, 3.0),
        ("sequence", "token_mask", 1.0, 1.05),
    ],
)
def test_sapo_matches_trl(level, mode, tau_pos, tau_neg):  # noqa: ANN001
    """TRL's sapo: -sigmoid(tau (r - 1)) * 4 / tau * A, tau by the advantage's sign, GRPO aggregation."""
    x = _inputs(zlib.crc32(f"sapo{level}{mode}".encode()) % 1000)
    theirs = _theirs("sapo", level, 0.0, mode, 3.0, *x, tau_pos=tau_pos, tau_neg=tau_neg)
    ours = _ours(
        *x,
        loss="sapo",
        ratio_level=level,
        sapo_tau_pos=tau_pos,
        sapo_tau_neg=tau_neg,
        aggregation="seq-mean-token-mean",
        mismatch=mode,
        tis_cap=3.0,
    )
    _same(ours, theirs)
