"""The trainer's per-step metric point and log line (what the dashboard and trackers draw)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from services.trainer.admit import zero_variance
from services.trainer.learner import StepResult
from shared.schema import GroupMsg, unpack_f32

log = logging.getLogger("services.trainer.loop")


def step_point(
    step: int,
    groups: list[GroupMsg],
    res: StepResult,
    *,
    wait_s: float,
    t_train: float,
    t_pub: float,
    t_ckpt: float,
    checkpointed: bool,
    bus_s: float,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One point for the step just trained (`step` is the new version; groups were trained on step - 1)."""
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups], dtype=torch.float32)
    staleness = [step - 1 - g.policy_version for g in groups]
    hist = Counter(staleness)
    lengths = [len(unpack_f32(c.logprobs)) for g in groups for c in g.completions]
    busy = t_train + t_pub + t_ckpt
    total = wait_s + busy
    return {
        "step": step,
        "loss": res.stats.get("loss", 0.0),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward_min": float(rewards.min()),
        "reward_max": float(rewards.max()),
        "zero_variance_groups": int(sum(zero_variance(g) for g in groups)),
        "grad_norm": res.grad_norm,
        "lr": res.lr,
        "updates": res.updates,
        "groups": len(groups),
        "tokens": res.tokens,
        "completion_len_mean": sum(lengths) / max(1, len(lengths)),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "wait_s": round(wait_s, 3),
        "train_s": round(t_train, 3),
        "fwd_bwd_s": round(res.fwd_bwd_s, 3),
        "optim_s": round(res.optim_s, 3),
        "publish_s": round(t_pub, 3),
        "checkpoint_s": round(t_ckpt, 3),
        "checkpointed": checkpointed,
        "idle_frac": round(wait_s / total, 4) if total > 0 else 0.0,
        # Time inside the bus (reads that found data, settle scripts) since the last point:
        # what the Redis transport costs a step, blocking for new data excluded.
        "bus_s": round(bus_s, 5),
        "bus_frac": round(bus_s / busy, 5) if busy > 0 else 0.0,
        "tokens_per_s": round(res.tokens / t_train, 1) if t_train > 0 else 0.0,
        **extra,
        **{k: v for k, v in res.stats.items() if k != "loss"},
    }


def log_step(job_id: str, steps: int, point: dict[str, Any]) -> None:
    log.info(
        "job %s step %d/%d: reward %.3f loss %.4f mismatch_kl %.4f is_frac %.3f stale %s "
        "(wait %.1fs train %.2fs publish %.2fs ckpt %.2fs)",
        job_id,
        point["step"],
        steps,
        point["reward_mean"],
        point["loss"],
        point.get("mismatch_kl", 0.0),
        point.get("is_frac", 0.0),
        point["staleness_hist"],
        point["wait_s"],
        point["train_s"],
        point["publish_s"],
        point["checkpoint_s"],
    )
