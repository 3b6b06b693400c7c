"""The Tinker API's built-in losses (pure torch), as its documentation defines them.

Every loss is a *sum* over the datum's tokens (no mean: the caller scales with its weights or
advantages), on inputs already shifted: position t of `logp`, `target_tokens`, `weights`,
`logprobs` (the sampler's) and `advantages` belongs to the token predicted at t. Shapes: [T]
per datum. `elementwise` is each token's term, the loss is its sum.

- cross_entropy:        -logp * weights
- importance_sampling:  -(p / q) * A, with p / q = exp(logp - logprobs) (the sampler's q)
- ppo:                  -min(r A, clip(r, lo, hi) A), lo/hi = clip_low/high_threshold (0.8 / 1.2)
- cispo:                -sg(clip(r, lo, hi)) * A * logp (0.0 / 4.0: capped from above only)
- dro:                  -(logp A - beta / 2 (logp - logprobs)^2) (beta 0.1)

burstrl's own GRPO losses (services/trainer/losses.py) normalise per batch and correct for a
stale sampler; these do neither: a Tinker loop computes its own advantages and weights.
"""

from __future__ import annotations

import torch

DEFAULTS = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.1},
}


class LossInputError(ValueError):
    """A loss config the loss cannot take (a user error: the call fails, nothing changes)."""


def _thresholds(loss: str, config: dict[str, float]) -> tuple[float, float]:
    c = {**DEFAULTS[loss], **config}
    lo, hi = c["clip_low_threshold"], c["clip_high_threshold"]
    if not 0.0 <= lo <= hi:
        raise LossInputError(f"loss_fn_config: clip thresholds must satisfy 0 <= low <= high, got {lo}, {hi}")
    return lo, hi


def elementwise_loss(
    loss: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """Each token's loss term [T] (differentiable in `logp`)."""
    if loss == "cross_entropy":
        return -logp * inputs["weights"]
    q, adv = inputs["logprobs"], inputs["advantages"]
    log_ratio = logp - q
    if loss == "importance_sampling":
        return -torch.exp(log_ratio) * adv
    if loss == "ppo":
        lo, hi = _thresholds(loss, config)
        ratio = torch.exp(log_ratio)
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    if loss == "cispo":
        lo, hi = _thresholds(loss, config)
        return -torch.exp(log_ratio).clamp(lo, hi).detach() * adv * logp
    if loss == "dro":
        beta = {**DEFAULTS["dro"], **config}["beta"]
        if beta < 0:
            raise LossInputError(f"loss_fn_config.beta must be >= 0, got {beta}")
        return -(logp * adv - 0.5 * beta * log_ratio.square())
    raise LossInputError(f"unknown loss {loss!r}")
