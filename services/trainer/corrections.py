"""Sampler/trainer mismatch corrections: importance weights, truncation and masking (pure torch).

Each correction turns the trainer's log-probs at the start of the batch (`old_logp`, the
proximal policy) and the sampler's (`sampler_logp`, what vLLM reported, maybe quantized,
maybe many versions stale) into one detached weight per token or per sequence. The policy
loss multiplies each token's loss by it, so the PPO ratio logp/old and the mismatch
weight old/sampler stay apart (decoupled PPO, as TRL, verl and SkyRL do).

Shapes: N completions, T positions; log-probs and `mask` are [N, T]. A `Correction`'s
weight is [N, T] for token-level modes and [N, 1] for sequence-level ones; its `truncated`
and `masked` flags are bool [N, T] over the trained tokens only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "geo_mask", "m2po", "none")


@dataclass(frozen=True)
class Correction:
    weight: torch.Tensor  # [N, T] or [N, 1], detached: multiplies each token's policy loss
    truncated: torch.Tensor  # bool [N, T]: trained tokens whose weight was clamped to a bound
    masked: torch.Tensor  # bool [N, T]: trained tokens whose weight was zeroed


def _log_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_sampler) per token, 0 off the mask, detached. [N, T]"""
    return ((old_logp - sampler_logp) * mask).detach()


def truncated_or_masked_is(
    diff: torch.Tensor, mask: torch.Tensor, *, level: str, action: str, cap: float, floor: float
) -> Correction:
    """TIS / MIS at token or sequence level (TRL's vllm_importance_sampling_mode).

    diff: log-ratio trainer/sampler [N, T] (0 off the mask). Sequence level takes the product
    of the token ratios (sum of log-ratios), as TRL and verl's rollout_is="sequence" do.
    truncate clamps the ratio into [floor, cap]; mask zeroes ratios outside it.
    """
    m = mask.bool()
    if level == "sequence":
        diff = diff.sum(dim=-1, keepdim=True)  # [N, 1]
    ratio = torch.exp(diff)
    outside = (ratio > cap) | (ratio < floor)
    flags = outside.expand_as(m) & m
    none = torch.zeros_like(m)
    if action == "truncate":
        return Correction(ratio.clamp(min=floor, max=cap), flags, none)
    return Correction(ratio.masked_fill(outside, 0.0), none, flags)


def icepop(diff: torch.Tensor, mask: torch.Tensor, *, low: float, high: float) -> Correction:
    """IcePop (Ring-1T, arXiv 2510.18855): M(k) = k if low <= k <= high else 0, per token.

    k = pi_train(theta_old) / pi_infer(theta_old). The same rule as slime's icepop_function
    (tis_clip_low / tis_clip) and TRL's token_mask with both clip bounds set; SkyRL's
    token_mask_is_threshold_low/high zero the same tokens (and leave the weight to its TIS).
    """
    return truncated_or_masked_is(diff, mask, level="token", action="mask", cap=high, floor=low)


def geo_mask(diff: torch.Tensor, mask: torch.Tensor, *, low: float, high: float) -> Correction:
    """Geometric-mean sequence rejection (verl Geo-RS, SkyRL sequence_mask_metric="geometric").

    A sequence is kept (weight 1) iff low <= exp(mean_t log(pi_old / pi_sampler)) <= high,
    else rejected (weight 0). Rejection only, no IS weight: verl's decoupled_geo_rs preset
    (rollout_is=None, rollout_rs="seq_mean_k1"). The mean makes the test length-invariant,
    unlike the product of token ratios. (verl's seq_mean_k1 statistic is -log r; with its
    default near-symmetric bounds that is the same window; this follows its documented
    ratio definition and SkyRL's code, which bound the ratio itself.)
    """
    m = mask.bool()
    n = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    geo = torch.exp(diff.sum(dim=-1, keepdim=True) / n)  # [N, 1]
    out = (geo < low) | (geo > high)
    return Correction((~out).to(diff.dtype), torch.zeros_like(m), out.expand_as(m) & m)


def m2po_cutoff(sq: torch.Tensor, tau: float) -> float:
    """The largest squared log-ratio M2PO keeps: tokens with sq > cutoff are masked.

    sq: 1-D, the squared log-ratios of every trained token of the batch. M2PO (Zheng et al.,
    arXiv 2510.01161, Sec. 4) masks the tokens with the largest (log r)^2 until the mean over
    the remaining tokens, the batch's M2, is at most tau. Sorted ascending, the prefix means
    only grow, so the kept set is the longest prefix whose mean is <= tau. Ties at the
    boundary are kept or masked together, so the result does not depend on token order.
    Returns +inf when nothing needs masking and -1.0 when even the smallest value is above tau
    (everything masked: this batch teaches nothing, which the stats show as mask_frac 1).

    Followed: the paper's masking rule, as AReaL implements it (areal/trainer/ppo/actor.py
    `_get_m2po_loss_mask`; AReaL keeps one token when all would go and uses a strict "<").
    The authors' released code (Infini-AI-Lab/M2PO) differs: it bounds M2 over the
    "harmful" tokens only (A>0 and r>1, or A<0 and r<1), caps |log r| at a threshold
    solved from that budget, and turns it into per-batch PPO clip bounds. We do not follow it.
    """
    if sq.numel() == 0:
        return math.inf
    v, _ = torch.sort(sq.detach().double().cpu())
    k = torch.arange(1, len(v) + 1, dtype=v.dtype)
    n_ok = int((torch.cumsum(v, 0) / k <= tau).sum())  # the prefix means grow: a prefix passes
    if n_ok == len(v):
        return math.inf
    if n_ok > 0 and v[n_ok] == v[n_ok - 1]:
        # The kept prefix may not end inside a run of equal values: back off to the run's start.
        n_ok = int(torch.searchsorted(v, v[n_ok - 1]))
    return float(v[n_ok - 1]) if n_ok > 0 else -1.0


def m2po(diff: torch.Tensor, mask: torch.Tensor, *, tau: float, cutoff: float | None = None) -> Correction:
    """M2PO: the untruncated weight pi_old/pi_sampler on kept tokens, 0 on the masked ones.

    The paper's objective is M_{i,t} * pi_theta/pi_behav * A; decoupled, pi_theta/pi_behav is
    the policy loss's ratio pi_theta/pi_old times this weight. `cutoff` comes from
    `m2po_cutoff` over the whole optimizer batch (the learner passes it when the batch is
    split into several passes or ranks); None computes it from these tokens alone.
    """
    m = mask.bool()
    sq = diff * diff
    cut = m2po_cutoff(sq[m], tau) if cutoff is None else cutoff
    drop = (sq > cut) & m
    return Correction(torch.exp(diff).masked_fill(drop, 0.0), torch.zeros_like(m), drop)


def mismatch_correction(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    cap: float = 2.0,
    floor: float = 0.0,
    icepop_bounds: tuple[float, float] = (0.5, 2.0),
    geo_bounds: tuple[float, float] = (0.99, 1.01),
    m2po_tau: float = 0.04,
    m2po_cut: float | None = None,
) -> Correction:
    """The correction named by `algorithm.mismatch` (see MODES); "none" weighs every token 1."""
    if mode == "none":
        m = mask.bool()
        return Correction(torch.ones_like(old_logp[:, :1]), torch.zeros_like(m), torch.zeros_like(m))
    diff = _log_ratio(old_logp, sampler_logp, mask)
    if mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        level, action = mode.split("_")
        return truncated_or_masked_is(diff, mask, level=level, action=action, cap=cap, floor=floor)
    if mode == "icepop":
        return icepop(diff, mask, low=icepop_bounds[0], high=icepop_bounds[1])
    if mode == "geo_mask":
        return geo_mask(diff, mask, low=geo_bounds[0], high=geo_bounds[1])
    if mode == "m2po":
        return m2po(diff, mask, tau=m2po_tau, cutoff=m2po_cut)
    raise ValueError(f"unknown mismatch mode {mode!r} ({', '.join(MODES)})")
