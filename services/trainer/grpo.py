"""GRPO math as small pure functions (torch only; no I/O).

Shapes in comments: B = groups in the batch, G = completions per group, N = B*G
completions, T = padded completion length. What differs from textbook GRPO:
- the importance ratio is taken against the *sampler's* log-probs (vLLM, maybe
  quantized, maybe a version stale), so it corrects both staleness and numerics;
- the ratio is clipped asymmetrically (DAPO clip-higher: clip_high > clip_low);
- a truncated importance-sampling (TIS) weight caps how far a single token can pull.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages. rewards: [B, G] -> [B, G].

    GRPO divides by the group std; Dr.GRPO (scale_by_std=False) does not, which avoids
    up-weighting groups that are nearly solved or nearly hopeless.
    """
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-prob of each target token. logits: [N, T, V], targets: [N, T] -> [N, T]."""
    # log_softmax in fp32: bf16 logits lose the tail that log-probs of rare tokens need.
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token; unbiased and >= 0."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean over every unmasked token of the batch (DAPO's aggregation)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip GRPO loss with TIS and an optional k3 KL term.

    logp, sampler_logp, mask: [N, T]; advantages: [N] (per sequence) or [N, T].
    Returns the scalar loss and detached statistics for metrics.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [N, 1|T]
    log_ratio = logp - sampler_logp  # [N, T]
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    # TIS: a detached weight that caps the importance of tokens the sampler under-rated.
    tis = torch.clamp(ratio.detach(), max=tis_cap)
    per_token = per_token * torch.where(ratio.detach() > tis_cap, tis / ratio.detach(), 1.0)
    loss = masked_mean(per_token, mask)
    stats: dict[str, float] = {}
    if ref_logp is not None and kl_coef > 0.0:
        kl = masked_mean(kl_k3(logp, ref_logp), mask)
        loss = loss + kl_coef * kl
        stats["kl_ref"] = float(kl.detach())
    with torch.no_grad():
        m = mask.bool()
        stats["clip_frac"] = float(((ratio != clipped) & m).float().sum() / m.sum().clamp(min=1))
        stats["tis_frac"] = float(((ratio > tis_cap) & m).float().sum() / m.sum().clamp(min=1))
        # k1 KL(sampler || trainer) on sampled tokens: the sampler/trainer mismatch.
        stats["mismatch_kl"] = float(masked_mean(-log_ratio, mask))
        stats["entropy_proxy"] = float(masked_mean(-logp, mask))
    return loss, stats
