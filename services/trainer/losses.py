"""KL estimators, aggregation and the policy-loss family (pure torch).

Shapes: N = completions, T = positions (already shifted: position t predicts token t+1).
Three log-prob tensors meet here, and keeping them apart is the point:
- `logp`: the trainer's, with gradient (the policy being optimised);
- `old_logp`: the trainer's at the start of this batch, detached (the PPO anchor; equal to
  `logp.detach()` on the first update of a batch);
- `sampler_logp`: what vLLM reported when it sampled (maybe quantized, maybe many versions
  stale). The mismatch weight old/sampler (services/trainer/corrections.py) corrects for the
  sampler not being the policy, separately from the PPO ratio logp/old (decoupled PPO, as
  TRL and verl do).

`algorithm.loss` picks the surrogate; each is a small function from log-probs and
advantages to a per-token loss and the tokens its trust region clipped (low, high). Which
name each has in verl, TRL, prime-rl and SkyRL, and its paper: docs/losses.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from services.trainer.corrections import mismatch_correction
from services.trainer.stats import masked_mean, mismatch_stats

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LossKind = Literal["ppo_clip", "cispo", "sapo", "dppo_tv"]
Surrogate = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per-token loss, clipped low, clipped high

# exp() of a log-ratio beyond this overflows fp32 in a square; verl and SkyRL clamp at 20 too.
_SAFE_LOG = 20.0

__all__ = ["LossConfig", "aggregate", "kl_per_token", "lr_lambda", "masked_mean", "policy_loss"]


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


# -- the policy-loss family: per-token surrogates ----------------------------------------
def ppo_clip(log_w: torch.Tensor, adv: torch.Tensor, *, clip_low: float, clip_high: float) -> Surrogate:
    """PPO's clipped surrogate, asymmetric bounds (DAPO). log_w: log(pi/pi_old) [N, T] or, for
    GSPO, the sequence's mean [N, 1]; adv [N, 1] or [N, T]. -min(r A, clip(r, 1-lo, 1+hi) A)."""
    ratio = torch.exp(log_w)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    return per_token, (ratio < 1.0 - clip_low) & (adv < 0), (ratio > 1.0 + clip_high) & (adv > 0)


def cispo(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, w_min: float, w_max: float) -> Surrogate:
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, w_min, w_max)) * A * log pi, per token.

    The IS weight r = pi/pi_old is clipped and detached, so no token's gradient is dropped,
    only capped (PPO zeroes the gradient of a clipped token). TRL's loss_type="cispo" with
    epsilon_high = w_max (TRL clips from above only: w_min = 0); SkyRL's cispo_eps_clip_low /
    high are offsets from 1 (defaults 1 and 4: [0, 5], the ScaleRL recipe). logp, old_logp [N, T].
    """
    r = torch.exp(logp.detach() - old_logp.detach())
    per_token = -r.clamp(min=w_min, max=w_max) * adv * logp
    return per_token, r < w_min, r > w_max


def sapo(log_w: torch.Tensor, adv: torch.Tensor, *, tau_pos: float, tau_neg: float) -> Surrogate:
    """SAPO (arXiv 2511.20347): a sigmoid gate instead of a hard clip, -f(r) A with
    f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg.

    f'(r) = 4 sigmoid (1 - sigmoid) is 1 at r = 1, so at the anchor the gradient is the plain
    policy gradient, and it decays smoothly (not to a hard zero) as r leaves 1; tau_neg > tau_pos
    damps negative updates faster. As TRL's loss_type="sapo", verl's and SkyRL's (which clamp
    log r at +-20, as here). log_w [N, T] or [N, 1] (sequence level).
    """
    ratio = torch.exp(log_w.clamp(-_SAFE_LOG, _SAFE_LOG))
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    per_token = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    no = torch.zeros_like(per_token, dtype=torch.bool)
    return per_token, no, no


def dppo_tv(logp: torch.Tensor, sampler_logp: torch.Tensor, adv: torch.Tensor, *, low: float, high: float) -> Surrogate:
    """DPPO-Binary-TV (arXiv 2602.04879): -r A on tokens inside a total-variation trust region.

    r = pi/mu against the behaviour (sampler) policy mu, as the paper's Sec. 5.2, prime-rl's
    default loss and SkyRL's "dppo" do: the trust region bounds the probability change
    p - mu of the sampled token, masking where A > 0 and p - mu > high, or A < 0 and
    p - mu < -low. Because r already carries the mismatch, no separate IS weight applies
    (AlgorithmSpec requires mismatch = "none"). prime-rl adds kl_tau * (log r)^2; verl and
    SkyRL do not, nor do we. logp, sampler_logp [N, T]; adv [N, 1] or [N, T].
    """
    r = torch.exp((logp - sampler_logp).clamp(-_SAFE_LOG, _SAFE_LOG))
    with torch.no_grad():
        diff = torch.exp(logp) - torch.exp(sampler_logp)
        out_high = (adv > 0) & (diff > high)
        out_low = (adv < 0) & (diff < -low)
    return -r * adv * (~(out_low | out_high)).to(r.dtype), out_low, out_high


# -- the loss ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LossConfig:
    loss: str = "ppo_clip"  # LossKind
    clip_low: float = 0.2
    clip_high: float = 0.28
    ratio_level: str = "token"  # "sequence": GSPO
    aggregation: str = "token-mean"
    max_tokens: int = 1  # for seq-mean-token-sum-norm
    mismatch: str = "token_truncate"  # corrections.MODES
    tis_cap: float = 2.0
    mismatch_min: float = 0.0
    kl_coef: float = 0.0  # KL in the loss; 0 when the KL goes into the reward instead
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    cispo_min: float = 0.0
    cispo_max: float = 5.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dppo_low: float = 0.2
    dppo_high: float = 0.2
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    geo_low: float = 0.99
    geo_high: float = 1.01
    m2po_tau: float = 0.04


def _log_w(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token log-ratios [N, T], or GSPO's geometric mean per sequence [N, 1]."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"unknown ratio level {level!r}")


def surrogate(
    cfg: LossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    sampler_logp: torch.Tensor | None,
) -> Surrogate:
    """The per-token policy loss `cfg.loss` names (before the mismatch weight)."""
    if cfg.loss in ("cispo", "dppo_tv") and cfg.ratio_level != "token":
        raise ValueError(f"loss {cfg.loss!r} works at ratio_level 'token' only")
    if cfg.loss == "ppo_clip":
        log_w = _log_w(logp - old_logp.detach(), mask, cfg.ratio_level)
        return ppo_clip(log_w, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    if cfg.loss == "sapo":
        log_w = _log_w(logp - old_logp.detach(), mask, cfg.ratio_level)
        return sapo(log_w, adv, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
    if cfg.loss == "cispo":
        return cispo(logp, old_logp, adv, w_min=cfg.cispo_min, w_max=cfg.cispo_max)
    if cfg.loss == "dppo_tv":
        if sampler_logp is None:
            raise ValueError("loss 'dppo_tv' needs the sampler's log-probs (its trust region is against them)")
        return dppo_tv(logp, sampler_logp, adv, low=cfg.dppo_low, high=cfg.dppo_high)
    raise ValueError(f"unknown loss {cfg.loss!r} (ppo_clip, cispo, sapo, dppo_tv)")


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
    m2po_cut: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Surrogate (cfg.loss) x mismatch weight (cfg.mismatch), + KL, - entropy bonus.

    logp, old_logp, sampler_logp, ref_logp, entropy, mask: [N, T]; advantages [N] or [N, T].
    m2po_cut: M2PO's cutoff over the whole optimizer batch (corrections.m2po_cutoff), when
    this call sees only part of it. Returns the scalar loss and detached statistics (local
    token means, see services/trainer/stats.py).
    """
    if cfg.loss == "dppo_tv" and cfg.mismatch != "none":
        raise ValueError("loss 'dppo_tv' is already relative to the sampler: use mismatch 'none'")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [N, 1|T]
    per_token, low, high = surrogate(cfg, logp, old_logp, adv, mask, sampler_logp)
    per_token = per_token.expand_as(logp) if per_token.shape != logp.shape else per_token

    stats: dict[str, float] = {"is_frac": 0.0, "mask_frac": 0.0}
    if sampler_logp is not None:
        corr = mismatch_correction(
            old_logp,
            sampler_logp,
            mask,
            mode=cfg.mismatch,
            cap=cfg.tis_cap,
            floor=cfg.mismatch_min,
            icepop_bounds=(cfg.icepop_low, cfg.icepop_high),
            geo_bounds=(cfg.geo_low, cfg.geo_high),
            m2po_tau=cfg.m2po_tau,
            m2po_cut=m2po_cut,
        )
        per_token = per_token * corr.weight
        stats.update(mismatch_stats(old_logp, sampler_logp, mask, corr.weight, corr.truncated, corr.masked))
    pg_loss = aggregate(per_token, mask, cfg.aggregation, n_tokens=n_tokens, n_seqs=n_seqs, max_tokens=cfg.max_tokens)
    loss = pg_loss
    stats["pg_loss"] = float(pg_loss.detach())

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
        low, high = low.expand_as(logp), high.expand_as(logp)
        stats["clip_low_frac"] = float(masked_mean(low.float(), mask))
        stats["clip_high_frac"] = float(masked_mean(high.float(), mask))
        stats["clip_frac"] = float(masked_mean((low | high).float(), mask))
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
