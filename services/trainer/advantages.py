"""Advantage estimators and reward shaping, as pure functions (torch only; no I/O).

Shapes: B = groups, G = completions per group, N = B*G completions, T = positions.
Sequence-level estimators return [B, G] (flatten to [N] for the loss); the distillation
estimator returns per-token advantages [N, T], which the loss takes as they are.
"""

from __future__ import annotations

from typing import Literal

import torch

from services.trainer.losses import kl_per_token

AdvantageKind = Literal["grpo", "dr_grpo", "rloo", "distill"]


def group_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages. rewards: [B, G] -> [B, G].

    GRPO divides by the group std; Dr.GRPO (scale_by_std=False) does not, which avoids
    up-weighting groups that are nearly solved or nearly hopeless.
    """
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean). [B, G] -> [B, G]."""
    g = rewards.shape[1]
    if g < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (g / (g - 1))


def distill_advantages(teacher_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """On-policy distillation: per-token advantage = log p_teacher - log p_sampler ([N, T]).

    Its expectation under the sampler is minus the reverse KL(student || teacher) per token,
    so policy-gradient ascent on it pulls the student toward the teacher on its own samples.
    """
    return ((teacher_logp - sampler_logp) * mask).detach()


def zero_variance_groups(rewards: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """[B, G] -> bool [B]: groups whose completions all scored the same (no GRPO signal)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) <= tol


def kl_penalised_rewards(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward: r - kl_coef * sum_t KL_t, per completion (detached).

    rewards: [B, G]; logp, ref_logp, mask: [N, T] with N = B*G. Returns the shaped rewards
    and the per-token KL mean (for metrics). `logp` is the sampler's: the penalty belongs to
    the sample as it was drawn, and needs no extra forward pass.
    """
    kl = kl_per_token(logp, ref_logp, estimator).detach() * mask  # [N, T]
    seq_kl = kl.sum(dim=-1).reshape(rewards.shape)  # [B, G]
    return rewards - kl_coef * seq_kl, kl.sum() / mask.sum().clamp(min=1.0)


def compute_advantages(
    kind: str,
    rewards: torch.Tensor,
    *,
    sampler_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> torch.Tensor:
    """Advantages for the loss: [N] for sequence-level estimators, [N, T] for distillation.

    distill with reward_weight > 0 adds reward_weight x the GRPO advantage of each completion
    to every one of its tokens: the teacher shapes each token, the verifier still ranks answers.
    """
    if kind == "grpo":
        return group_advantages(rewards).reshape(-1)
    if kind == "dr_grpo":
        return group_advantages(rewards, scale_by_std=False).reshape(-1)
    if kind == "rloo":
        return rloo_advantages(rewards).reshape(-1)
    if kind == "distill":
        if ref_logp is None or sampler_logp is None or mask is None:
            raise ValueError("distill advantages need teacher (ref) and sampler log-probs")
        adv = distill_advantages(ref_logp, sampler_logp, mask)
        if reward_weight > 0.0:
            adv = adv + reward_weight * group_advantages(rewards).reshape(-1, 1) * mask
        return adv
    raise ValueError(f"unknown advantage estimator {kind!r}")
