"""What every trainer step reports about off-policy data, whatever the loss and correction.

The same numbers for every algorithm, so runs can be compared. Each is a mean over the
trained tokens (mask = 1) of one forward/backward pass; the learner weights passes by their
token counts and sums across ranks, then `finish` turns the summed parts into ratios.
Keys in the trainer's metric point (see docs/losses.md):

- m2: the batch's second moment of the token log-ratios, mean of (log pi_old - log pi_sampler)^2
  (pi_old: the trainer at the start of the batch). M2PO bounds it; 0 means on-policy.
- mismatch_kl / mismatch_k3: KL(sampler || trainer) on the sampled tokens, k1 and k3 estimators.
- mask_frac: trained tokens whose loss the correction zeroed (token/sequence masks, IcePop,
  Geo-RS, M2PO).
- is_frac: trained tokens whose weight was truncated or masked.
- clip_frac (clip_low_frac, clip_high_frac): trained tokens the policy loss's trust region
  clipped or capped (PPO clip, CISPO's weight cap, DPPO's TV mask; SAPO has no hard clip).
- ess: normalised effective sample size of the weights the loss applied, (sum w)^2 / (n sum w^2):
  1 when every token counts the same, k/n when only k of n count.
- ess_raw: the same for the raw ratios pi_old/pi_sampler before truncation or masking.
"""

from __future__ import annotations

import torch

# Log-ratios beyond this are clamped in the stats only (the raw-ratio ESS, k3): e^20 is already
# "infinitely" off-policy, and squaring e^45 overflows fp32 (verl's SAFETY_BOUND, the same reason).
_SAFE_LOG = 20.0

# Token means the learner reduces (a fixed list: every rank must all-reduce the same vector).
MEAN_KEYS = [
    "clip_frac",
    "clip_high_frac",
    "clip_low_frac",
    "entropy",
    "is_frac",
    "mask_frac",
    "m2",
    "mismatch_k3",
    "mismatch_kl",
    "w_mean",
    "w_sq_mean",
    "r_mean",
    "r_sq_mean",
]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean over every unmasked token of the batch (DAPO's aggregation)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def ess(w: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) of weights w over the mask. [N, T]"""
    return normalised_ess(float(masked_mean(w, mask)), float(masked_mean(w * w, mask)))


def normalised_ess(w_mean: float, w_sq_mean: float) -> float:
    """ESS / n from the weights' mean and mean square: mean^2 / mean-square (0 if all weights are 0)."""
    return w_mean * w_mean / w_sq_mean if w_sq_mean > 0.0 else 0.0


@torch.no_grad()
def mismatch_stats(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    truncated: torch.Tensor,
    masked: torch.Tensor,
) -> dict[str, float]:
    """Token means of one pass. [N, T] each; weight [N, T] or [N, 1] (a sequence-level weight
    counts once per token, like the loss applies it)."""
    d = sampler_logp - old_logp.detach()
    w = weight.expand_as(mask)
    r = torch.exp((-d).clamp(-_SAFE_LOG, _SAFE_LOG))
    return {
        "m2": float(masked_mean(d * d, mask)),
        "mismatch_kl": float(masked_mean(d, mask)),
        # Clamped like the ESS's ratios: a metric point must stay finite JSON, even for a token
        # the sampler found e^-90 times less likely than the trainer does.
        "mismatch_k3": float(masked_mean(torch.exp((-d).clamp(max=_SAFE_LOG)) + d - 1.0, mask)),
        "mask_frac": float(masked_mean(masked.float(), mask)),
        "is_frac": float(masked_mean((truncated | masked).float(), mask)),
        "w_mean": float(masked_mean(w, mask)),
        "w_sq_mean": float(masked_mean(w * w, mask)),
        "r_mean": float(masked_mean(r, mask)),
        "r_sq_mean": float(masked_mean(r * r, mask)),
    }


def finish(means: dict[str, float]) -> dict[str, float]:
    """Reduced token means -> reported stats: the ESS parts become `ess` and `ess_raw`."""
    out = dict(means)
    parts = [out.pop(k, None) for k in ("w_mean", "w_sq_mean", "r_mean", "r_sq_mean")]
    if parts[0] is not None and parts[1] is not None:
        out["ess"] = normalised_ess(parts[0], parts[1])
    if parts[2] is not None and parts[3] is not None:
        out["ess_raw"] = normalised_ess(parts[2], parts[3])
    return out
