"""Per-token log-probs, KL estimators, mismatch weights and the policy loss (pure torch).

Shapes: N = completions, T = positions (already shifted: position t predicts token t+1).
Three log-prob tensors meet here, and keeping them apart is the point:
- `logp`: the trainer's, with gradient (the policy being optimised);
- `old_logp`: the trainer's at the start of this batch, detached (the PPO anchor; equal to
  `logp.detach()` on the first update of a batch);
- `sampler_logp`: what vLLM reported when it sampled (maybe quantized, maybe a version or
  two stale). The mismatch weight old/sampler corrects for the sampler not being the
  policy, separately from the PPO ratio logp/old (decoupled PPO, as TRL and verl do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MismatchMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]


# -- KL(policy || ref) per token, from samples of the policy ---------------------------
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log(pi/ref): unbiased, high variance, can be negative per token."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """0.5 * log(pi/ref)^2: biased, low variance, >= 0; its gradient is that of the true KL's."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3: ref/pi - log(ref/pi) - 1; unbiased and >= 0 (GRPO's choice)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


_KL = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    try:
        return _KL[estimator](logp, ref_logp)
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3)") from None


# -- aggregation ----------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean over every unmasked token of the batch (DAPO's aggregation)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
    max_tokens: int = 1,
) -> torch.Tensor:
    """Reduce [N, T] per-token losses to a scalar.

    n_tokens / n_seqs: the denominators over the *whole* (mini)batch. Data-parallel ranks
    and mini-batches pass the global counts so that summing the ranks' gradients gives
    exactly the gradient of the one-process loss; by default the local counts are used.
    """
    n_tokens = float(mask.sum()) if n_tokens is None else n_tokens
    n_seqs = float(mask.shape[0]) if n_seqs is None else n_seqs
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / max(n_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).sum() / max(n_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(n_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant, so long answers are not discounted
        return masked.sum() / (max(n_seqs, 1.0) * max_tokens)
    raise ValueError(f"unknown aggregation {mode!r}")


# -- sampler/trainer mismatch ---------------------------------------------------------
def mismatch_weights(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    cap: float,
    floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights trainer/sampler (detached) and which tokens they corrected.

    token_*: one weight per token; sequence_*: the product over the sequence (one per row).
    *_truncate clamps into [floor, cap] (TIS); *_mask zeroes weights outside it (MIS).
    Returns (weights [N, T] or [N, 1], bool [N, T]: tokens whose weight was truncated/masked).
    """
    m = mask.bool()
    if mode == "none":
        return torch.ones_like(old_logp[:, :1]), torch.zeros_like(m)
    diff = ((old_logp - sampler_logp) * mask).detach()
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    outside = (ratio > cap) | (ratio < floor)
    if mode.endswith("truncate"):
        w = ratio.clamp(min=floor, max=cap)
    elif mode.endswith("mask"):
        w = ratio.masked_fill(outside, 0.0)
    else:
        raise ValueError(f"unknown mismatch mode {mode!r}")
    return w, outside.expand_as(m) & m


# -- the loss ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    ratio_level: str = "token"  # "sequence": GSPO
    aggregation: str = "token-mean"
    max_tokens: int = 1  # for seq-mean-token-sum-norm
    mismatch: str = "token_truncate"
    tis_cap: float = 2.0
    mismatch_min: float = 0.0
    kl_coef: float = 0.0  # KL in the loss; 0 when the KL goes into the reward instead
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    sampler_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (token or sequence ratio) x mismatch weight, + KL, - entropy bonus.

    logp, old_logp, sampler_logp, ref_logp, entropy, mask: [N, T]; advantages [N] or [N, T].
    Returns the scalar loss and detached statistics (local means) for metrics.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [N, 1|T]
    log_ratio = logp - old_logp.detach()
    if cfg.ratio_level == "sequence":  # GSPO: geometric mean of token ratios, one per sequence
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [N, 1]
    elif cfg.ratio_level == "token":
        log_w = log_ratio
    else:
        raise ValueError(f"unknown ratio level {cfg.ratio_level!r}")
    ratio = torch.exp(log_w)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [N, 1|T] broadcast below
    per_token = per_token.expand_as(logp) if per_token.shape != logp.shape else per_token

    is_frac = torch.zeros(())
    if sampler_logp is not None and cfg.mismatch != "none":
        w, corrected = mismatch_weights(
            old_logp, sampler_logp, mask, mode=cfg.mismatch, cap=cfg.tis_cap, floor=cfg.mismatch_min
        )
        per_token = per_token * w
        is_frac = masked_mean(corrected.float(), mask)
    pg_loss = aggregate(per_token, mask, cfg.aggregation, n_tokens=n_tokens, n_seqs=n_seqs, max_tokens=cfg.max_tokens)
    loss = pg_loss

    stats: dict[str, float] = {"pg_loss": float(pg_loss.detach())}
    if ref_logp is not None:
        kl = kl_per_token(logp, ref_logp, cfg.kl_estimator)
        if cfg.kl_coef > 0.0:
            # Same aggregation as the policy term, so kl_coef means the same under every mode.
            kl_term = aggregate(kl, mask, cfg.aggregation, n_tokens=n_tokens, n_seqs=n_seqs, max_tokens=cfg.max_tokens)
            loss = loss + cfg.kl_coef * kl_term
        stats["kl_ref"] = float(masked_mean(kl.detach(), mask))
    if entropy is not None:
        ent_mean = (entropy * mask).sum() / max(float(mask.sum()) if n_tokens is None else n_tokens, 1.0)
        if cfg.entropy_coef > 0.0:
            loss = loss - cfg.entropy_coef * ent_mean
        stats["entropy"] = float(masked_mean(entropy.detach(), mask))
    with torch.no_grad():
        r = ratio.expand_as(logp)
        a = adv.expand_as(logp)
        low = (r < 1.0 - cfg.clip_low) & (a < 0)
        high = (r > 1.0 + cfg.clip_high) & (a > 0)
        stats["clip_low_frac"] = float(masked_mean(low.float(), mask))
        stats["clip_high_frac"] = float(masked_mean(high.float(), mask))
        stats["clip_frac"] = float(masked_mean((low | high).float(), mask))
        stats["is_frac"] = float(is_frac)
        if sampler_logp is not None:
            # KL(sampler || trainer) on the sampled tokens: k1 (mean log-ratio) and k3 (>= 0).
            d = sampler_logp - old_logp.detach()
            stats["mismatch_kl"] = float(masked_mean(d, mask))
            stats["mismatch_k3"] = float(masked_mean(torch.exp(-d) + d - 1.0, mask))
        stats["loss"] = float(loss.detach())
    return loss, stats


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):  # noqa: ANN201 (a closure for LambdaLR)
    """LR multiplier per scheduler step: linear warmup, then constant or cosine to 0."""

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        if schedule == "cosine":
            span = max(1, total_steps - warmup_steps)
            progress = min(1.0, (step - warmup_steps) / span)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown lr schedule {schedule!r}")

    return f
