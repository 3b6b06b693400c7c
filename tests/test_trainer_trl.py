"""Cross-check: our loss and its gradient equal TRL's GRPOTrainer._compute_loss on identical inputs.

TRL's loss is a method of GRPOTrainer that reads its configuration from `self`; we call it
unbound with a stand-in `self` whose `_get_per_token_logps_and_entropies` returns our
log-prob tensor (a leaf with a gradient). Everything after that line of TRL runs as
shipped: PPO clip, vLLM importance-sampling weight, k3 KL, aggregation per loss_type,
entropy bonus. TRL's vLLM IS ratio is built the way its _generate_and_score_completions
builds it (exp(old - sampler), clamped or masked), since that part runs at generation time.
"""

from __future__ import annotations

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


def _trl_is_ratio(old, sampler, mask, mode: str, cap: float):  # noqa: ANN001, ANN202
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=None, max=cap)
    return r.masked_fill((r < -math.inf) | (r > cap), 0.0)


def _trl_loss(loss_type, level, beta, entropy_coef, mode, cap, logp_leaf, old, sampler, ref, mask, adv, ent):  # noqa: ANN001, ANN202
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_leaf, ent, None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
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
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    inputs = {
        "prompt_ids": torch.zeros(N, 1, dtype=torch.long),
        "prompt_mask": torch.ones(N, 1, dtype=torch.long),
        "completion_ids": torch.zeros(N, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "importance_sampling_ratio": _trl_is_ratio(old, sampler, mask, mode, cap),
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
