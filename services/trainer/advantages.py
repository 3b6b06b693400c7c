"""Advantage estimators and reward shaping, as pure functions (torch only; no I/O).

Shapes: B = groups, G = completions per group, N = B*G completions, T = positions.
Sequence-level estimators return [B, G] (flatten to [N] for the loss); the distillation
estimator and the turn-level one (multi-turn episodes, `compute_turn_advantages`) return
per-token advantages [N, T], which the loss takes as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from services.trainer.losses import kl_per_token

AdvantageKind = Literal["grpo", "dr_grpo", "rloo", "distill", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
TURN_KINDS = ("grpo", "dr_grpo", "rloo")  # the group-baselined estimators that have a turn level


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


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, *, baseline: bool = False, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): rewards whitened over the whole batch. [B, G], [N, T] -> [N].

    As verl's reinforce_plus_plus (outcome reward, gamma = 1: every token's return is its
    completion's reward) and reinforce_plus_plus_baseline (the group mean subtracted first):
    mean and variance are over every trained token of the batch (verl's masked_whiten, so a
    completion weighs by its length; the variance unbiased, eps inside the square root).
    The KL, when in the reward, is already in `rewards` for the whole completion (the
    papers put it per token into the return-to-go instead).
    """
    scores = rewards - rewards.mean(dim=1, keepdim=True) if baseline else rewards
    flat = scores.reshape(-1)  # [N]
    n_i = mask.sum(dim=-1).to(flat.dtype)  # trained tokens per completion
    n = n_i.sum()
    mean = (flat * n_i).sum() / n.clamp(min=1.0)
    var = ((flat - mean) ** 2 * n_i).sum() / (n - 1.0).clamp(min=1.0)
    return (flat - mean) * torch.rsqrt(var + eps)


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

    The GRPO family baselines within each group; REINFORCE++ normalises over the batch.

    distill with reward_weight > 0 adds reward_weight x the GRPO advantage of each completion
    to every one of its tokens: the teacher shapes each token, the verifier still ranks answers.
    """
    if kind == "grpo":
        return group_advantages(rewards).reshape(-1)
    if kind == "dr_grpo":
        return group_advantages(rewards, scale_by_std=False).reshape(-1)
    if kind == "rloo":
        return rloo_advantages(rewards).reshape(-1)
    if kind in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        if mask is None:
            raise ValueError(f"{kind} advantages need the loss mask (they are whitened over tokens)")
        return reinforce_pp_advantages(rewards, mask, baseline=kind == "reinforce_plus_plus_baseline")
    if kind == "distill":
        if ref_logp is None or sampler_logp is None or mask is None:
            raise ValueError("distill advantages need teacher (ref) and sampler log-probs")
        adv = distill_advantages(ref_logp, sampler_logp, mask)
        if reward_weight > 0.0:
            adv = adv + reward_weight * group_advantages(rewards).reshape(-1, 1) * mask
        return adv
    raise ValueError(f"unknown advantage estimator {kind!r}")


# -- per-turn advantages (multi-turn episodes) ---------------------------------------------
def _episode_level(kind: str, returns: torch.Tensor) -> torch.Tensor:
    """The sequence-level estimator `kind` on [B, G] values (the same calls as compute_advantages)."""
    if kind == "grpo":
        return group_advantages(returns)
    if kind == "dr_grpo":
        return group_advantages(returns, scale_by_std=False)
    if kind == "rloo":
        return rloo_advantages(returns)
    raise ValueError(f"turn-level advantages need grpo, dr_grpo or rloo, not {kind!r}")


def _masked_level(kind: str, returns: torch.Tensor, reached: torch.Tensor, eps: float) -> torch.Tensor:
    """The estimator over only the `reached` entries of each group ([B, G] -> [B, G]).

    Entries not reached, and groups with fewer than 2 reached, come out meaningless: the
    caller replaces them (a baseline needs at least one other episode to compare with).
    """
    m = reached.to(returns.dtype)
    n = m.sum(dim=1, keepdim=True)
    mean = (returns * m).sum(dim=1, keepdim=True) / n.clamp(min=1.0)
    centered = returns - mean
    if kind == "dr_grpo":
        return centered
    if kind == "rloo":
        return centered * n / (n - 1.0).clamp(min=1.0)
    if kind == "grpo":
        var = (centered * centered * m).sum(dim=1, keepdim=True) / (n - 1.0).clamp(min=1.0)
        return centered / (var.sqrt() + eps)
    raise ValueError(f"turn-level advantages need grpo, dr_grpo or rloo, not {kind!r}")


def turn_advantages(
    kind: str, rewards: torch.Tensor, turn_rewards: Sequence[torch.Tensor], *, eps: float = 1e-6
) -> list[torch.Tensor]:
    """Per-turn advantages A_{i,k} of N = B*G episodes; returns N tensors of [K_i].

    rewards: [B, G], each episode's reward R_i (the one episode-level advantages use: the
    environment's parts plus the verifier's score on the final answer, KL-shaped when the
    KL goes into the reward). turn_rewards: N tensors [K_i], the environment's step reward
    r_{i,k} of each model turn k (row-major: episode i = b*G + g). An empty one (a single-turn
    completion, an episode whose reset failed) counts as one turn with step reward 0.

    - Rewards per turn: r_{i,k}, plus the terminal remainder R_i - sum_k r_{i,k} on the last
      turn, so the turns' rewards sum to R_i (the final answer's score belongs to the last turn).
    - Return-to-go: G_{i,k} = sum_{j>=k} r_{i,j} = R_i - sum_{j<k} r_{i,j} (computed in that
      second form, so G_{i,0} is R_i exactly).
    - Baseline per turn index k: among the group's episodes that reached turn k (K_j > k),
      grpo: (G_{i,k} - mean) / (std + eps); dr_grpo: G_{i,k} - mean; rloo: the leave-one-out
      (G_{i,k} - mean) * n / (n - 1), with n such episodes. When fewer than 2 reached turn k,
      there is nothing to compare with: A_{i,k} = A_{i,k-1} (the episode's previous turn's).

    Every episode reaches turn 0 and G_{i,0} = R_i, so A_{i,0} is the episode-level advantage,
    bit for bit (same function, same tensor). A turn index every episode of the batch reached
    goes through that same function too, so with no step rewards (G_{i,k} = R_i) and episodes
    of equal turn counts, every turn's advantage is its episode's advantage exactly.
    """
    if kind not in TURN_KINDS:
        raise ValueError(f"turn-level advantages need grpo, dr_grpo or rloo, not {kind!r}")
    b, g = rewards.shape
    if len(turn_rewards) != b * g:
        raise ValueError(f"{len(turn_rewards)} episodes' turn rewards for {b}x{g} rewards")
    flat = rewards.reshape(-1)
    steps = [r.to(rewards.dtype).reshape(-1) if r.numel() else rewards.new_zeros(1) for r in turn_rewards]
    k_max = max(len(r) for r in steps)
    returns = rewards.new_zeros(b * g, k_max)
    reached = torch.zeros(b * g, k_max, dtype=torch.bool)
    for i, r in enumerate(steps):
        before = torch.cat([r.new_zeros(1), torch.cumsum(r[:-1], dim=0)])  # sum_{j<k} r_j
        returns[i, : len(r)] = flat[i] - before
        reached[i, : len(r)] = True
    returns, reached = returns.reshape(b, g, k_max), reached.reshape(b, g, k_max)

    adv = torch.zeros_like(returns)
    adv[:, :, 0] = _episode_level(kind, returns[:, :, 0])
    for k in range(1, k_max):
        m = reached[:, :, k]
        if g >= 2 and bool(m.all()):
            adv[:, :, k] = _episode_level(kind, returns[:, :, k])
            continue
        enough = (m.sum(dim=1, keepdim=True) >= 2) & m  # [B, G]: reached, in a group of >= 2 that did
        adv[:, :, k] = torch.where(enough, _masked_level(kind, returns[:, :, k], m, eps), adv[:, :, k - 1])
    adv = adv.reshape(b * g, k_max)
    return [adv[i, : len(r)].clone() for i, r in enumerate(steps)]


def spread_turn_advantages(
    turn_adv: Sequence[torch.Tensor],
    turn_starts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    lengths: Sequence[int],
    mask: torch.Tensor,
) -> torch.Tensor:
    """Per-turn advantages -> per-token [N, T] on the batch's shifted positions.

    Completion i's token j (predicted at position offsets[i] + j, i.e. prompt length - 1 + j)
    belongs to the last turn k with turn_starts[i][k] <= j (tokens before the first start, if
    any, to turn 0), so turn k's tokens run from its start to the next turn's start or the end;
    observation tokens inside that span get the turn's value, then `mask` zeroes them (and the
    prompt and padding), so they carry no gradient.
    """
    out = torch.zeros_like(mask)
    for i, (a, starts, off, n) in enumerate(zip(turn_adv, turn_starts, offsets, lengths, strict=True)):
        if n == 0:
            continue
        s = starts.to(torch.long).reshape(-1) if starts.numel() else torch.zeros(1, dtype=torch.long)
        if len(s) != len(a):
            raise ValueError(f"completion {i}: {len(s)} turn starts for {len(a)} turn advantages")
        turn = (torch.searchsorted(s, torch.arange(n), right=True) - 1).clamp(min=0)
        out[i, off : off + n] = a.to(out.dtype)[turn]
    return (out * mask).detach()


def compute_turn_advantages(
    kind: str,
    rewards: torch.Tensor,
    turn_starts: Sequence[torch.Tensor],
    turn_rewards: Sequence[torch.Tensor],
    *,
    offsets: Sequence[int],
    lengths: Sequence[int],
    mask: torch.Tensor,
) -> torch.Tensor:
    """algorithm.advantage_level = "turn": per-token advantages [N, T] (see `turn_advantages`).

    turn_starts[i] / turn_rewards[i]: completion i's turns (indices into its token ids, and
    step rewards); empty for a completion without turns (one turn from token 0).
    """
    return spread_turn_advantages(turn_advantages(kind, rewards, turn_rewards), turn_starts, offsets, lengths, mask)
