"""What the trainer reports: one metric point per step, and one per session (a burst).

A step's point carries the batch's rewards, the loss statistics, the lag of the data it
trained on (a histogram in policy versions) and where the time went. A session's points
("trainer_session": start and end) carry what a rented card is billed for: the seconds the
trainer process was alive (start-up and model load included), the steps and groups it
trained in that time, and the lag of that data; the dashboard draws bursts from them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from shared.schema import GroupMsg, unpack_f32


@dataclass(frozen=True)
class StepTimes:
    wait_s: float  # waiting for a full batch
    train_s: float  # forward, backward and optimizer
    publish_s: float  # policy files, probe, version upload, pointer
    checkpoint_s: float
    bus_s: float  # inside the bus (reads that found data, settle scripts) since the last point


def zero_variance(g: GroupMsg, tol: float = 1e-6) -> bool:
    rewards = [c.reward for c in g.completions]
    return max(rewards) - min(rewards) <= tol


def step_point(
    step: int,
    groups: list[GroupMsg],
    res: Any,  # learner.TrainResult
    t: StepTimes,
    *,
    checkpointed: bool,
    dropped_zero_variance: int,
    ledger: dict[str, int],
) -> dict[str, Any]:
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups], dtype=torch.float32)
    staleness = [step - 1 - g.policy_version for g in groups]  # step s trains on top of version s-1
    hist = Counter(staleness)
    lengths = [len(unpack_f32(c.logprobs)) for g in groups for c in g.completions]
    busy = t.train_s + t.publish_s + t.checkpoint_s
    total = t.wait_s + busy
    return {
        "step": step,
        "loss": res.stats.get("loss", 0.0),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward_min": float(rewards.min()),
        "reward_max": float(rewards.max()),
        "zero_variance_groups": int(sum(zero_variance(g) for g in groups)),
        "dropped_zero_variance": dropped_zero_variance,
        "grad_norm": res.grad_norm,
        "lr": res.lr,
        "updates": res.updates,
        "groups": len(groups),
        "tokens": res.tokens,
        "completion_len_mean": sum(lengths) / max(1, len(lengths)),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "wait_s": round(t.wait_s, 3),
        "train_s": round(t.train_s, 3),
        "fwd_bwd_s": round(res.fwd_bwd_s, 3),
        "optim_s": round(res.optim_s, 3),
        "publish_s": round(t.publish_s, 3),
        "checkpoint_s": round(t.checkpoint_s, 3),
        "checkpointed": checkpointed,
        "idle_frac": round(t.wait_s / total, 4) if total > 0 else 0.0,
        "bus_s": round(t.bus_s, 5),
        # The ledger as a time series (fed, trained, dropped_*, dead, in flight per step).
        "ledger": ledger,
        "bus_frac": round(t.bus_s / busy, 5) if busy > 0 else 0.0,
        "tokens_per_s": round(res.tokens / t.train_s, 1) if t.train_s > 0 else 0.0,
        **{k: v for k, v in res.stats.items() if k != "loss"},
    }


class Session:
    """One trainer session on one job (a burst): from the process start to leaving the job."""

    def __init__(self, *, process_start: float, epoch: int, replica: str, step: int) -> None:
        self.process_start, self.epoch, self.replica = process_start, epoch, replica
        self.claimed_at = time.time()
        self.first_step, self.steps, self.groups = step, 0, 0
        self.lag_sum = 0.0
        self.lag_hist: Counter[str] = Counter()

    def trained(self, point: dict[str, Any]) -> None:
        self.steps += 1
        self.groups += point["groups"]
        self.lag_sum += point["staleness_mean"] * point["groups"]
        self.lag_hist.update({k: int(v) for k, v in point["staleness_hist"].items()})

    def point(self, event: str, *, reason: str = "") -> dict[str, Any]:
        now = time.time()
        return {
            "event": event,  # "start" | "end"
            "epoch": self.epoch,
            "replica": self.replica,
            "process_start": round(self.process_start, 3),
            "claimed_at": round(self.claimed_at, 3),
            "startup_s": round(self.claimed_at - self.process_start, 3),  # process start -> job leased
            "billable_s": round(now - self.process_start, 3),  # the process has been alive this long
            "first_step": self.first_step,
            "steps": self.steps,
            "groups": self.groups,
            "lag_mean": round(self.lag_sum / self.groups, 3) if self.groups else None,
            "lag_hist": dict(sorted(self.lag_hist.items(), key=lambda kv: int(kv[0]))),
            "reason": reason,
        }
