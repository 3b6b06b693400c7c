"""Backlog plus bursts as arithmetic: how long a rented trainer is held per on/off cycle, and
how much it trains, when the always-on cards generate into a backlog around the clock.

`predict_bursts` is a pure function of rates and times, so a benchmark can put its measured
rates in and compare the predicted billable seconds with the ones it counted (bench/burst.py),
and the planner (`pricing.py`) can put its estimated rates in to price a layout.

The model, per cycle of `period_s` seconds:
- A window of `duty_cycle x period_s` seconds opens; the trainer may be alive only inside it.
  It starts at the window's start and spends `startup_s` (billable) before its first step:
  machine start, model load, the first backlog fetch. It leaves with `teardown_s` (billable)
  before it is gone: noticing the backlog is empty (the trainer's leave_when_idle_s), the exit
  checkpoint, process exit. Start-up + teardown must fit in the window.
- The always-on side produces `rollout_rate` groups/s all the time into the backlog, up to
  `backlog_cap` groups; a full backlog makes it idle (it never drops data).
- Without a burst-side replica, the trainer trains `trainer_rate` groups/s while the backlog
  holds groups, and exits when it is empty (or the window closes). Billable: start-up +
  that + teardown.
- Unless fresh groups keep it fed: the trainer leaves only after `leave_idle_s` without a
  batch (its --leave-when-idle). When the always-on side makes a batch of `batch` groups in less
  than that (batch / rollout_rate < leave_idle_s), it never leaves: once the backlog is empty
  it trains at rollout's pace until the window closes, billed for the waiting between batches
  ("fed"). `leave_idle_s` 0 models a trainer that leaves the moment the backlog is empty.
- With a burst-side replica (`replica_rate` > 0: what a rollout engine on the rented card would
  generate alone), the trainer first drains the backlog, then shares the card with the replica
  until the window closes: the replica takes the fraction f = (trainer - rollout) /
  (trainer + replica) of the card, so that the two generators supply exactly what the trainer,
  slowed to (1 - f) x trainer_rate, consumes. Billable: the whole window.
- Steady state: every cycle starts with the backlog the last one left.

Billable seconds are the seconds the rented card is held: from the trainer process's start
(start-up and model load included) until it exits; a replica on the same card adds nothing
beyond the trainer's alive interval (count the union, not the sum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BurstCycle:
    """One steady-state cycle of backlog plus bursts (seconds and groups)."""

    period_s: float
    window_s: float  # duty_cycle x period_s: when the trainer may be alive
    billable_s: float  # start-up + training (+ sharing with the replica)
    billable_share: float  # billable_s / period_s
    trained_groups: float
    backlog_groups: float  # waiting when the first step starts
    drain_s: float  # training at trainer_rate on the backlog
    mixed_s: float  # training beside the replica (or fed by rollout), after the backlog emptied
    replica_share: float  # f: the fraction of the card the replica takes while mixed
    home_idle_share: float  # of the period, the always-on side idled on a full backlog
    limited_by: str  # "backlog empty" | "backlog cap" | "window" | "fed" (rollout kept it from leaving)


def _check(name: str, value: float, low: float, *, low_ok: bool, high: float = math.inf, inf_ok: bool = False) -> None:
    if not (math.isfinite(value) or (inf_ok and value == math.inf)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (value == low and not low_ok) or value > high:
        bounds = f"{'>=' if low_ok else '>'} {low:g}" + (f" and <= {high:g}" if math.isfinite(high) else "")
        raise ValueError(f"{name} must be {bounds}, got {value!r}")


def predict_bursts(
    *,
    rollout_rate: float,
    trainer_rate: float,
    duty_cycle: float,
    startup_s: float,
    period_s: float,
    backlog_cap: float = math.inf,
    replica_rate: float = 0.0,
    teardown_s: float = 0.0,
    batch: float = 1.0,
    leave_idle_s: float = 0.0,
) -> BurstCycle:
    """Predict one steady-state cycle; rates in groups per second (see the module docstring).

    >>> c = predict_bursts(rollout_rate=1.0, trainer_rate=4.0, duty_cycle=0.5, startup_s=60, period_s=3600)
    >>> round(c.billable_s), c.limited_by  # 60 s start-up + 3600 x 1/4 s of training
    (960, 'backlog empty')
    >>> c = predict_bursts(rollout_rate=1.0, trainer_rate=4.0, duty_cycle=0.5, startup_s=60, period_s=3600,
    ...                    teardown_s=40)
    >>> c.billable_s  # ... + 40 s to notice the empty backlog, checkpoint and exit
    1000.0
    """
    _check("rollout_rate", rollout_rate, 0.0, low_ok=True)
    _check("trainer_rate", trainer_rate, 0.0, low_ok=False)
    _check("duty_cycle", duty_cycle, 0.0, low_ok=False, high=1.0)
    _check("startup_s", startup_s, 0.0, low_ok=True)
    _check("period_s", period_s, 0.0, low_ok=False)
    _check("backlog_cap", backlog_cap, 0.0, low_ok=True, inf_ok=True)
    _check("replica_rate", replica_rate, 0.0, low_ok=True)
    _check("teardown_s", teardown_s, 0.0, low_ok=True)
    _check("batch", batch, 0.0, low_ok=False)
    _check("leave_idle_s", leave_idle_s, 0.0, low_ok=True)
    r_h, r_t, P = rollout_rate, trainer_rate, period_s
    W = duty_cycle * P
    room = max(0.0, W - startup_s - teardown_s)  # training time the window allows
    f = mixed = 0.0
    # (With trainer_rate <= rollout_rate the backlog never empties: the window limits, below.)
    fed = replica_rate <= 0 and leave_idle_s > 0 and r_t > r_h > 0 and batch / r_h < leave_idle_s
    if replica_rate <= 0 and not fed:
        if r_t > r_h:
            drain = r_h * P / r_t  # steady state: train what one period produced
            backlog = r_h * (P - drain)  # produced since the last burst's training ended
            limited = "backlog empty"
            if backlog > backlog_cap:  # the always-on side idled once the backlog was full
                backlog, drain, limited = backlog_cap, backlog_cap / (r_t - r_h), "backlog cap"
        else:
            drain, backlog, limited = room, backlog_cap, "window"
        if drain > room:
            drain, backlog, limited = room, backlog_cap, "window"
        trained = r_t * drain
        billable = min(W, startup_s + drain + teardown_s) if drain > 0 else min(startup_s + teardown_s, W)
    else:
        # A replica, or rollout feeding a trainer that never leaves: either way the trainer holds
        # the window, and the backlog holds what was made since the last one closed (the mixed
        # phase kept it empty). Fed, with no replica, f = (r_t - r_h) / r_t: the trainer runs at
        # rollout's pace, idle the rest of the time.
        backlog = min(r_h * (P - W + startup_s), backlog_cap)
        if r_t > r_h:
            drain = min(room, backlog / (r_t - r_h))
            f = (r_t - r_h) / (r_t + replica_rate)
        else:
            drain = room  # the trainer is the bottleneck: a replica would only slow it
        mixed = room - drain
        trained = r_t * drain + (1 - f) * r_t * mixed
        billable, limited = W, "fed" if fed else "window"
        if fed:
            f = 0.0  # no card share goes to a replica
    home_made = trained - f * replica_rate * mixed
    if limited == "window" and math.isinf(backlog_cap):
        home_made = r_h * P  # the backlog grows without bound: nothing idles (not a steady state)
    idle = 0.0 if r_h <= 0 else max(0.0, 1 - home_made / (r_h * P))
    return BurstCycle(
        period_s=P,
        window_s=W,
        billable_s=billable,
        billable_share=billable / P,
        trained_groups=trained,
        backlog_groups=backlog,
        drain_s=drain,
        mixed_s=mixed,
        replica_share=f,
        home_idle_share=idle,
        limited_by=limited,
    )
