"""The GRPO-family math, re-exported from the small modules that hold it.

- advantages.py: GRPO / Dr.GRPO / RLOO / distillation advantages (episode or per-turn level),
  KL-in-reward, zero-variance groups;
- losses.py: per-token log-probs and entropy, k1/k2/k3 KL, mismatch (TIS/MIS) weights,
  aggregation modes, the PPO-clip / GSPO policy loss, the LR schedule.

Kept so existing imports (`from services.trainer.grpo import token_logprobs`) keep working.
"""

from __future__ import annotations

from services.trainer.advantages import (
    compute_advantages,
    compute_turn_advantages,
    distill_advantages,
    group_advantages,
    kl_penalised_rewards,
    rloo_advantages,
    spread_turn_advantages,
    turn_advantages,
    zero_variance_groups,
)
from services.trainer.losses import (
    LossConfig,
    aggregate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_per_token,
    lr_lambda,
    masked_mean,
    mismatch_weights,
    policy_loss,
    token_logprobs,
    token_logprobs_and_entropy,
)

__all__ = [
    "LossConfig",
    "aggregate",
    "compute_advantages",
    "compute_turn_advantages",
    "distill_advantages",
    "group_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalised_rewards",
    "kl_per_token",
    "lr_lambda",
    "masked_mean",
    "mismatch_weights",
    "policy_loss",
    "rloo_advantages",
    "spread_turn_advantages",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "turn_advantages",
    "zero_variance_groups",
]
