"""What a layout costs the user: rented card-hours and dollars per 1000 trained steps, per way
of running it, within a staleness limit.

The modes (`ModeCost.mode`):
- `all-rented`: every role on the rented card(s), colocated, during bursts (issue 20's (a)).
- `windowed`: today's split: the trainer on the rented card steps only when the home cards
  have sampled; the rented card is billed while it waits ((b)).
- `backlog`: the home cards generate around the clock into a backlog; a burst drains it at
  the trainer's own speed and ends when it is empty ((c)).
- `backlog+replica`: the same, then a rollout replica on the rented card shares it with the
  trainer until the burst's window closes ((c) with a burst-side replica).
- `owned`: every card is yours: it runs around the clock and costs nothing per hour.

A backlog sampled while the trainer is away holds one policy version, so a burst that trains
S steps from it trains its last groups S versions late: the staleness limit caps the backlog
at about `max_lag` x batch groups (`backlog_cap`). Everything here is arithmetic over the
role times `placement.py` estimated; `bursts.predict_bursts` holds the cycle model.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from services.plan.bursts import BurstCycle, predict_bursts
from services.plan.catalog import Card
from services.plan.memory import Workload

HOURS_PER_WEEK = 168.0
# Policy versions a trained group may lag by default: measured, not M2PO's paper's 256. On the
# SmolLM2 demo's own versions (bench/results/smollm2_lag.md), M2PO masks none of a batch 8
# versions stale (M2 0.03, under its tau 0.04) and up to 8% at 16 (M2 0.08-0.14); the rule that
# picks 8 was fixed before that run. A job whose steps move the policy less tolerates more: say so
# with --max-lag.
DEFAULT_MAX_LAG = 8
# Options within this fraction of the cheapest cost per step count as equally cheap (the time
# model is good to about ±50%); among them the plan takes the one that trains most per week.
COST_TIE = 0.05
# Wire format of a group (shared/schema.py): prompt ids int32; per completion token the id
# (int32), the sampler's log-prob (float32), the loss mask (uint8), the ref's log-prob
# (float32) when there is a ref. Exact for the arrays, at full completion length (an upper bound).
PROMPT_BYTES_PER_TOKEN = 4
COMPLETION_BYTES_PER_TOKEN = 4 + 4 + 1
REF_BYTES_PER_TOKEN = 4
# The prompt and completion text travel too: UTF-8, about 4 bytes per BPE token in English
# (estimated; code and CJK text differ).
TEXT_BYTES_PER_TOKEN = 4
Mode = Literal["all-rented", "windowed", "backlog", "backlog+replica", "owned"]


class BurstPattern(BaseModel):
    """When the user rents: sessions of at most `burst_hours`, at most `bursts_per_week`."""

    burst_hours: float = Field(default=10.0, gt=0, le=HOURS_PER_WEEK, allow_inf_nan=False)
    bursts_per_week: int = Field(default=3, ge=1)
    startup_minutes: float = Field(
        default=5.0, ge=0, allow_inf_nan=False, description="Billable minutes per burst before the first step."
    )
    teardown_minutes: float = Field(
        default=1.0,
        ge=0,
        allow_inf_nan=False,
        description="Billable minutes per burst after the last step: noticing the backlog is drained "
        "(the trainer's --leave-when-idle), the exit checkpoint, process exit.",
    )
    max_lag: int = Field(
        default=DEFAULT_MAX_LAG, ge=1, description="Staleness limit: policy versions a trained group may lag."
    )

    @model_validator(mode="after")
    def _fits_a_week(self) -> BurstPattern:
        if self.bursts_per_week * self.burst_hours > HOURS_PER_WEEK:
            raise ValueError(
                f"{self.bursts_per_week} bursts of {self.burst_hours:g} h do not fit in a week (168 h): "
                f"use at most {int(HOURS_PER_WEEK // self.burst_hours)} bursts per week"
            )
        if self.startup_minutes + self.teardown_minutes >= self.burst_hours * 60:
            raise ValueError(
                f"a start-up of {self.startup_minutes:g} min and a teardown of {self.teardown_minutes:g} min "
                f"leave no time to train in a {self.burst_hours:g} h burst: use shorter ones or longer bursts"
            )
        return self

    @property
    def duty_cycle(self) -> float:
        return self.bursts_per_week * self.burst_hours / HOURS_PER_WEEK


class Sides(BaseModel):
    """A layout reduced to what pricing needs (built by `placement.py`)."""

    placement: str
    layout: str
    trainer_cards: list[tuple[str, int]]  # the burst side: the trainer's cards (and a ref beside it)
    home_cards: list[tuple[str, int]]  # the always-on side: rollout (and a ref beside it)
    trainer_side_s: float  # seconds per step of what runs on the trainer's cards
    sampler_side_s: float  # seconds per step (one batch of groups) of the home side
    step_s: float  # the layout's step as `placement.py` ranks it
    replica_s: float | None = None  # a burst-side replica's seconds per batch, alone on the card
    replica_memory_share: float | None = None  # its gpu_memory_utilization beside the trainer
    uses_ref: bool = False


class ModeCost(BaseModel):
    """One way of running one layout, priced."""

    mode: Mode
    layout: str
    available: bool = True
    why_not: str = ""
    home_groups_per_h: float = 0.0
    rented_groups_per_h: float = 0.0
    replica_groups_per_h: float = 0.0
    replica_share: float = Field(default=0.0, description="Fraction of the rented card's time the replica takes.")
    replica_memory_share: float = Field(default=0.0, description="The replica's gpu_memory_utilization.")
    bursts_per_week: float = 0.0
    billable_hours_per_burst: float = 0.0
    billable_share: float = Field(default=0.0, description="Of the week, the rented card is held this share.")
    rented_hours_per_1k_steps: float = Field(default=0.0, description="Rented card-hours per 1000 trained steps.")
    cost_per_1k_steps: float = Field(default=0.0, description="USD per 1000 trained steps.")
    steps_per_week: float = 0.0
    lag_max: int = Field(default=1, description="Policy versions the stalest trained group lags (estimated).")
    lag_mean: float = 1.0
    backlog_groups: float = 0.0
    backlog_gb: float = 0.0
    home_idle_share: float = Field(default=0.0, description="Of the week, home cards idle on a full backlog.")
    bursts_to_fill_home: int = Field(
        default=0, description="Bursts per week that would keep the home cards busy at the same cost per step."
    )
    within_limit: bool = True
    uses_rented: bool = False
    leave_when_idle_s: float = Field(
        default=0.0,
        description="The trainer's --leave-when-idle for this mode: half the home side's seconds per batch, so "
        "a drained burst ends instead of training at home's pace (0: stay, with a replica beside it).",
    )


def group_bytes(w: Workload, ref: bool) -> dict[str, float]:
    """Bytes of one group on the wire: the arrays (exact) and the text (estimated)."""
    tokens = w.group_size * w.completion_len
    arrays = w.prompt_len * PROMPT_BYTES_PER_TOKEN + tokens * (
        COMPLETION_BYTES_PER_TOKEN + (REF_BYTES_PER_TOKEN if ref else 0)
    )
    return {"arrays": float(arrays), "text": float((w.prompt_len + tokens) * TEXT_BYTES_PER_TOKEN)}


def _hourly(cards: dict[str, Card], group: list[tuple[str, int]], rented: bool | None = None) -> float:
    return sum(n * cards[c].price_per_hour for c, n in group if rented is None or cards[c].owned != rented)


def _rented_count(cards: dict[str, Card], group: list[tuple[str, int]]) -> int:
    return sum(n for c, n in group if not cards[c].owned)


def _bursting(
    mode: Mode, sides: Sides, cards: dict[str, Card], p: BurstPattern, w: Workload, step_s: float
) -> ModeCost:
    """all-rented / windowed: every card of the layout held for whole bursts."""
    group = sides.trainer_cards + sides.home_cards
    train_h = p.burst_hours - (p.startup_minutes + p.teardown_minutes) / 60
    steps_burst = train_h * 3600 / step_s
    steps_week = steps_burst * p.bursts_per_week
    held_h = p.burst_hours * p.bursts_per_week
    k = 1000 / steps_week
    return ModeCost(
        mode=mode,
        layout=sides.layout,
        home_groups_per_h=0.0 if mode == "all-rented" else 3600 / sides.sampler_side_s * w.batch,
        rented_groups_per_h=3600 / step_s * w.batch,
        bursts_per_week=p.bursts_per_week,
        billable_hours_per_burst=p.burst_hours,
        billable_share=p.duty_cycle,
        rented_hours_per_1k_steps=_rented_count(cards, group) * held_h * k,
        cost_per_1k_steps=_hourly(cards, group) * held_h * k,
        steps_per_week=steps_week,
        lag_max=1,
        lag_mean=1.0 if mode == "windowed" else 0.0,
        uses_rented=_rented_count(cards, group) > 0,
    )


def _backlog(sides: Sides, cards: dict[str, Card], p: BurstPattern, w: Workload, replica: bool) -> ModeCost:
    """backlog / backlog+replica: home side around the clock, trainer side in bursts."""
    mode: Mode = "backlog+replica" if replica else "backlog"
    out = ModeCost(mode=mode, layout=sides.layout, uses_rented=True)
    r_h = w.batch / sides.sampler_side_s  # groups per second
    r_t = w.batch / sides.trainer_side_s
    r_g = w.batch / sides.replica_s if replica and sides.replica_s else 0.0
    out.home_groups_per_h, out.rented_groups_per_h, out.replica_groups_per_h = r_h * 3600, r_t * 3600, r_g * 3600
    if replica and not r_g:
        return out.model_copy(update={"available": False, "why_not": "no rollout replica fits beside the trainer"})
    # A home group reaches the trainer this many versions after the version it was sampled from.
    arrival_lag = math.ceil(sides.sampler_side_s / sides.trainer_side_s)
    room = p.max_lag - arrival_lag
    if room < 1:
        why = f"home groups already lag {arrival_lag} versions on arrival, over --max-lag {p.max_lag}"
        return out.model_copy(update={"available": False, "within_limit": False, "why_not": why})
    cap = float(room * w.batch)
    # Shorter than the home side's batch interval, or a drained burst never ends (bursts.py, "fed").
    leave = 0.0 if replica else round(sides.sampler_side_s / 2, 1)
    best: tuple[float, float, int, BurstCycle] | None = None
    for n in range(1, p.bursts_per_week + 1):
        period = HOURS_PER_WEEK / n * 3600
        c = predict_bursts(
            rollout_rate=r_h,
            trainer_rate=r_t,
            duty_cycle=p.burst_hours * 3600 / period,
            startup_s=p.startup_minutes * 60,
            teardown_s=p.teardown_minutes * 60,
            period_s=period,
            backlog_cap=cap,
            replica_rate=r_g,
            batch=w.batch,
            leave_idle_s=leave,
        )
        steps_week = n * c.trained_groups / w.batch
        if steps_week <= 0:
            continue
        week_cost = n * c.billable_s / 3600 * _hourly(cards, sides.trainer_cards) + HOURS_PER_WEEK * _hourly(
            cards, sides.home_cards
        )
        per_k = week_cost / steps_week * 1000
        key = (per_k, -steps_week)
        if best is None or _better(key, best[:2]):
            best = (per_k, -steps_week, n, c)
    if best is None:
        return out.model_copy(update={"available": False, "why_not": "no step fits in a burst"})
    per_k, neg_steps, n, c = best
    steps_week = -neg_steps
    mixed_step = w.batch / ((1 - c.replica_share) * r_t) if c.mixed_s > 0 else 0.0
    mixed_lag = math.ceil(sides.sampler_side_s / mixed_step) if mixed_step else 0
    drain_lag = math.ceil(c.backlog_groups / w.batch) + arrival_lag
    lag_max = max(drain_lag, mixed_lag, 1)
    rented_h_week = n * c.billable_s / 3600 * _rented_count(cards, sides.trainer_cards)
    rented_h_week += HOURS_PER_WEEK * _rented_count(cards, sides.home_cards)
    size = group_bytes(w, sides.uses_ref)
    home_made = c.trained_groups - c.replica_share * r_g * c.mixed_s  # per cycle
    fill = math.floor(HOURS_PER_WEEK * 3600 * r_h / home_made) if home_made > 0 else 0
    return out.model_copy(
        update={
            "leave_when_idle_s": leave,
            "replica_share": c.replica_share,
            "replica_memory_share": (sides.replica_memory_share or 0.0) if replica else 0.0,
            "bursts_per_week": n,
            "billable_hours_per_burst": c.billable_s / 3600,
            "billable_share": c.billable_share,
            "rented_hours_per_1k_steps": rented_h_week / steps_week * 1000,
            "cost_per_1k_steps": per_k,
            "steps_per_week": steps_week,
            "lag_max": lag_max,
            "lag_mean": c.backlog_groups / w.batch / 2 + arrival_lag,
            "backlog_groups": c.backlog_groups,
            "backlog_gb": c.backlog_groups * sum(size.values()) / 1e9,
            "home_idle_share": c.home_idle_share,
            "bursts_to_fill_home": max(n, fill),
            "within_limit": lag_max <= p.max_lag,
            "why_not": "" if lag_max <= p.max_lag else f"home groups lag {mixed_lag} versions beside the replica",
        }
    )


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """(cost, -steps) a beats b: clearly cheaper, or as cheap (COST_TIE) and trains more."""
    if a[0] < b[0] * (1 - COST_TIE):
        return True
    if b[0] < a[0] * (1 - COST_TIE):
        return False
    return a[1] < b[1]


def price_layout(sides: Sides, cards: dict[str, Card], p: BurstPattern, w: Workload) -> list[ModeCost]:
    """Every mode that applies to this layout, priced."""
    group = sides.trainer_cards + sides.home_cards
    if _rented_count(cards, group) == 0:  # all owned: around the clock, per-hour cost from --price only
        steps_week = HOURS_PER_WEEK * 3600 / sides.step_s
        return [
            ModeCost(
                mode="owned",
                layout=sides.layout,
                home_groups_per_h=3600 / sides.sampler_side_s * w.batch if sides.home_cards else 0.0,
                rented_groups_per_h=0.0,
                billable_share=1.0,
                cost_per_1k_steps=_hourly(cards, group) * HOURS_PER_WEEK / steps_week * 1000,
                steps_per_week=steps_week,
                lag_max=1,
            )
        ]
    if sides.placement == "colocated":
        return [_bursting("all-rented", sides, cards, p, w, sides.step_s)]
    out = [_bursting("windowed", sides, cards, p, w, max(sides.trainer_side_s, sides.sampler_side_s))]
    if _rented_count(cards, sides.trainer_cards) == 0:
        why = "the trainer's cards are owned: no burst to drain a backlog into"
        out += [ModeCost(mode=m, layout=sides.layout, available=False, why_not=why) for m in ("backlog",)]
        return out
    out.append(_backlog(sides, cards, p, w, replica=False))
    out.append(_backlog(sides, cards, p, w, replica=True))
    return out


def usable(m: ModeCost) -> bool:
    return m.available and m.within_limit and m.steps_per_week > 0


def rank_key(m: ModeCost) -> tuple[float, float]:
    return (m.cost_per_1k_steps, -m.steps_per_week)


def cheapest(options: list[ModeCost]) -> ModeCost | None:
    """The cheapest usable option per trained step (ties within COST_TIE: most steps per week)."""
    best: ModeCost | None = None
    for m in options:
        if usable(m) and (best is None or _better(rank_key(m), rank_key(best))):
            best = m
    return best
