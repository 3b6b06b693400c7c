"""Placement: which cards run which role, and which layout and way of running it to recommend.

`plan()` is the planner's one entry point (the CLI calls it, `report.py` renders its `Plan`).
It tries every way to give the trainer k cards of one type and the rollout/ref the rest
(disaggregated, burstrl's way), and every k cards of one type running all roles (colocated,
vLLM and training sharing memory, as most frameworks do), sizes each role (`roles.py`),
prices each layout's ways of running (`pricing.py`), and keeps the best that fits:
- objective "cost" (the default): the lowest cost per trained step within the staleness
  limit, among layouts that use a rented card when one was listed (a card you list to rent
  is one you mean to use; the best layout without it is named in the notes);
- objective "time": the fastest step, as before the planner knew prices.

Disaggregated roles overlap (the trainer learns from step N while rollout samples N+1 under
the staleness budget), so its step is the slower side; colocated roles take turns, so its
step is the sum.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from services.plan.catalog import Card
from services.plan.memory import (
    GB,
    Method,
    ServeSettings,
    Workload,
    ref_memory,
    serve_weight_bytes,
    trainer_memory,
)
from services.plan.model_shape import ModelShape
from services.plan.pricing import HOURS_PER_WEEK, BurstPattern, ModeCost, Sides, cheapest, price_layout, usable
from services.plan.roles import EFFICIENT_TOKENS, Efficiency, RolePlan, plan_ref, plan_rollout, plan_trainer

Placement = Literal["disaggregated", "colocated"]
Objective = Literal["cost", "time"]
# A colocated k-card trainer shards (FSDP) only if that makes the step this much faster, or if
# only sharded does everything fit: the time model is good to about ±50%, and one process per
# card without all-gathers is the simpler thing to run.
SHARD_GAIN = 0.05
# Where each number comes from (report.py prints it; --json carries it).
PROVENANCE = {
    "trainer memory": "calibrated: tensor bytes within ±5% of measured CPU steps (bench/results/plan_calibration.md); "
    "GPU context and allocator slack assumed (+1 GB, +5%)",
    "rollout and ref memory": "estimated: mirrors vLLM's profiling formula, not measured",
    "step times and rates": "estimated: FLOPs/bandwidth model with mfu and bw_eff, expect ±50%",
    "prices": "given: catalog defaults (typical 2025-2026 on-demand rates) or --price",
    "start-up": "assumed: --startup-minutes per burst",
    "teardown": "assumed: --teardown-minutes per burst (on the tiny model on CPU, bench/burst.py measured "
    "the trainer's leave-when-idle wait + exit checkpoint + exit at 3.4 s with a 2 s wait)",
    "costs, cadence, lag": "estimated: arithmetic over the estimated rates (services/plan/bursts.py)",
    "backlog bytes": "exact for the wire format's arrays (shared/schema.py) at full completion length; "
    "text estimated at 4 B/token",
}


class Plan(BaseModel):
    """The planner's answer; `report.py` renders it, `--json` prints it."""

    model: str
    params_b: float
    method: str
    workload: Workload
    placement: Placement
    fits: bool
    step_time_s: float
    roles: list[RolePlan]
    ref_side: Literal["trainer", "sampler", "shared"] | None = None
    trainer_side_s: float = Field(description="Seconds per step of what runs on the trainer's cards.")
    sampler_side_s: float = Field(description="Seconds per step (one batch) of the rollout side.")
    replica: RolePlan | None = Field(default=None, description="A burst-side rollout replica beside the trainer.")
    objective: Objective = "cost"
    mode: str = Field(default="", description="The recommended way to run this layout (pricing.ModeCost.mode).")
    costs: list[ModeCost] = Field(default_factory=list, description="This layout's ways of running, priced.")
    comparison: list[ModeCost] = Field(default_factory=list, description="The best layout for each way of running.")
    pattern: BurstPattern | None = None
    prices: dict[str, dict[str, Any]] = Field(default_factory=dict)
    provenance: dict[str, str] = Field(default_factory=lambda: dict(PROVENANCE))
    alternatives: list[dict[str, object]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def layout(self) -> str:
        return ", ".join(f"{r.role}: {r.count}x {r.card}" for r in self.roles)

    def chosen_cost(self) -> ModeCost | None:
        return next((m for m in self.costs if m.mode == self.mode), None)


def _combine(times: list[float]) -> float:
    """Groups working in parallel on shares proportional to their speed."""
    rate = sum(1 / t for t in times if t > 0 and math.isfinite(t))
    return 1 / rate if rate else math.inf


def _method_str(method: Method) -> str:
    return f"lora r={method.rank}" if method.kind == "lora" else "full"


def _replica(shape: ModelShape, w: Workload, card: Card, k: int, eff: Efficiency, used_gb: float) -> RolePlan | None:
    """A rollout engine beside the trainer during a burst, in a fixed memory share: what the
    trainer (and a ref beside it) leave free at their peak, so it can never run them out of memory."""
    free = card.memory_gb - used_gb - ServeSettings().overhead_gb  # keep a context's worth spare
    if free <= 0:
        return None
    r = plan_rollout(shape, w, card, k, eff, None, budget_gb=free)
    if not r.fits:
        return None
    r.notes = [f"burst-side replica in the {free:.1f} GB the trainer leaves free"]
    return r


def _disaggregated(
    shape: ModelShape,
    method: Method,
    w: Workload,
    pool: dict[str, tuple[Card, int]],
    trainer_card: Card,
    k: int,
    ref: bool,
    weights: str | None,
    eff: Efficiency,
) -> list[Plan]:
    """One plan per place the ref could go (beside the trainer, or beside one card type's rollout)."""
    trainer = plan_trainer(shape, method, w, trainer_card, k, eff)
    rest = {n: (c, cnt - (k if n == trainer_card.name else 0)) for n, (c, cnt) in pool.items()}
    rest = {n: v for n, v in rest.items() if v[1] > 0}
    base = [plan_rollout(shape, w, c, cnt, eff, weights) for c, cnt in rest.values()]
    # (rollouts, ref, where the ref is, trainer-side seconds, sampling-side seconds)
    options: list[tuple[list[RolePlan], RolePlan | None, str | None, float, float]] = []
    if not ref:
        options.append((base, None, None, trainer.time_s, _combine([r.time_s for r in base if r.fits])))
    elif trainer.fits:  # one ref replica per trainer card, in the trainer's headroom
        r = plan_ref(shape, w, trainer_card, trainer.headroom_gb, eff, share=False)
        r.count, r.time_s = k, r.time_s / k
        r.notes.append("beside the trainer")
        options.append((base, r, "trainer", trainer.time_s + r.time_s, _combine([x.time_s for x in base if x.fits])))
    for i, (card, cnt) in enumerate(rest.values() if ref else []):
        # One ref replica beside each rollout engine of this type; vLLM gets the rest of the card.
        want = max(1, min(w.sequences, EFFICIENT_TOKENS // w.seq_len))
        need_gb = min(ref_memory(shape, w, want).peak_bytes / GB, card.memory_gb)
        r = plan_ref(shape, w, card, need_gb, eff, share=False)
        r.count, r.time_s = cnt, r.time_s / cnt
        r.notes.append(f"beside rollout on each {card.name}")
        rolls = list(base)
        rolls[i] = plan_rollout(shape, w, card, cnt, eff, weights, budget_gb=card.memory_gb - r.peak_gb)
        t_sample = _combine([x.time_s for x in rolls if x.fits]) + r.time_s
        options.append((rolls, r, "sampler", trainer.time_s, t_sample))
    notes: list[str] = [] if rest else ["no cards left for rollout"]
    if not options:
        options.append((base, None, None, trainer.time_s, math.inf))
    plans = []
    for rollouts, ref_plan, ref_side, t_train, t_sample in options:
        ok = any(x.fits for x in rollouts) and (ref_plan is None or ref_plan.fits)
        beside = ref_plan.peak_gb if ref_side == "trainer" and ref_plan else 0.0
        plans.append(
            Plan(
                model=shape.name,
                params_b=shape.n_params / 1e9,
                method=_method_str(method),
                workload=w,
                placement="disaggregated",
                fits=trainer.fits and ok,
                step_time_s=max(t_train, t_sample),
                roles=[trainer, *rollouts] + ([ref_plan] if ref_plan else []),
                ref_side=ref_side,  # type: ignore[arg-type]
                trainer_side_s=t_train,
                sampler_side_s=t_sample,
                replica=_replica(shape, w, trainer_card, k, eff, trainer.peak_gb + beside) if trainer.fits else None,
                notes=list(notes),
            )
        )
    return plans


def _colocated(
    shape: ModelShape,
    method: Method,
    w: Workload,
    card: Card,
    k: int,
    ref: bool,
    weights: str | None,
    eff: Efficiency,
) -> Plan:
    """All roles on k cards of one type. On k > 1 cards the trainer either replicates (DDP, no
    all-gathers) or shards (FSDP): a replicated trainer's resident weights and states leave vLLM
    and the ref what one card minus a whole model copy holds, so a model that fits DDP alone
    may leave them nothing (Qwen2.5-32B LoRA on 4x H100). The replicated plan is kept when it
    fits and the sharded one is not clearly (SHARD_GAIN) faster."""
    replicated = _colocated_with(shape, method, w, card, k, ref, weights, eff, shard=False)
    if k == 1:
        return replicated
    sharded = _colocated_with(shape, method, w, card, k, ref, weights, eff, shard=True)
    if not sharded.fits:
        return replicated
    if replicated.fits and replicated.step_time_s * (1 - SHARD_GAIN) <= sharded.step_time_s:
        return replicated
    return sharded


def _colocated_with(
    shape: ModelShape,
    method: Method,
    w: Workload,
    card: Card,
    k: int,
    ref: bool,
    weights: str | None,
    eff: Efficiency,
    shard: bool,
) -> Plan:
    # vLLM sleep mode: during training vLLM keeps only its context; weights go to host RAM, KV is dropped.
    sleeping = ServeSettings().overhead_gb * GB
    ref_weights = serve_weight_bytes(shape, card.serve_dtype) if ref and method.kind == "full" else 0.0
    trainer = plan_trainer(
        shape, method, w, card, k, eff, extra_static=sleeping, shardable_static=ref_weights, shard=shard
    )
    chosen = trainer._settings
    assert chosen is not None
    static = sum(trainer_memory(shape, method, w, chosen).components.values())
    static += chosen.overhead_gb * GB + ref_weights / chosen.fsdp_shards
    rollout = plan_rollout(shape, w, card, k, eff, weights, budget_gb=(card.memory_bytes - static) / GB)
    rollout.notes.append("vLLM in sleep mode while the trainer steps")
    roles = [trainer, rollout]
    t = trainer.time_s + rollout.time_s
    fits = trainer.fits and rollout.fits
    if ref:
        # The ref is the trainer's own model (LoRA: adapter disabled; full: a frozen copy kept beside it).
        ref_plan = plan_ref(shape, w, card, (card.memory_bytes - static) / GB, eff, share=True)
        ref_plan.count, ref_plan.time_s = k, ref_plan.time_s / k
        if method.kind == "full":  # its weights are the frozen copy counted in the trainer's static
            ref_plan.layout["shares_trainer_weights"] = ref_plan.min_layout["shares_trainer_weights"] = False
            ref_plan.notes.append("a frozen copy of the base beside the trainer")
        roles.append(ref_plan)
        t += ref_plan.time_s
        fits = fits and ref_plan.fits
    return Plan(
        model=shape.name,
        params_b=shape.n_params / 1e9,
        method=_method_str(method),
        workload=w,
        placement="colocated",
        fits=fits,
        step_time_s=t,
        roles=roles,
        ref_side="shared" if ref else None,
        trainer_side_s=t,
        sampler_side_s=rollout.time_s,
    )


def _sides(p: Plan) -> Sides:
    trainer = p.roles[0]
    home: dict[str, int] = {}
    for r in p.roles[1:]:
        if p.placement == "disaggregated" and r.role == "rollout":
            home[r.card] = home.get(r.card, 0) + r.count
    return Sides(
        placement=p.placement,
        layout=p.layout,
        trainer_cards=[(trainer.card, trainer.count)],
        home_cards=list(home.items()),
        trainer_side_s=p.trainer_side_s,
        sampler_side_s=p.sampler_side_s,
        step_s=p.step_time_s,
        replica_s=p.replica.time_s if p.replica else None,
        replica_memory_share=p.replica.recommended["gpu_memory_utilization"] if p.replica else None,
        uses_ref=p.ref_side is not None,
    )


class LayoutOptions(BaseModel):
    """What the layouts may be, beyond the model, method, workload and cards: `candidates` takes
    them, and `plan` passes them on (one set of options, so the two cannot drift apart)."""

    model_config = ConfigDict(frozen=True)

    placement: Literal["auto", "disaggregated", "colocated"] = "auto"
    ref: bool = True  # a reference model runs (the KL term), somewhere
    rollout_weights: str | None = None  # the weights rollout serves, as the CLI's --rollout-weights
    eff: Efficiency = Field(default_factory=Efficiency)


def candidates(
    shape: ModelShape, method: Method, w: Workload, cards: list[tuple[Card, int]], opts: LayoutOptions | None = None
) -> list[Plan]:
    """Every layout over `cards` (unpriced): k cards of each type for the trainer, the rest
    for rollout (one plan per place for the ref), and k cards of each type colocated."""
    opts = opts or LayoutOptions()
    placement, ref, rollout_weights, eff = opts.placement, opts.ref, opts.rollout_weights, opts.eff
    pool: dict[str, tuple[Card, int]] = {}
    for card, count in cards:
        pool[card.name] = (card, pool.get(card.name, (card, 0))[1] + count)
    out: list[Plan] = []
    for card, count in pool.values():
        for k in range(1, count + 1):
            if placement in ("auto", "disaggregated"):
                out += _disaggregated(shape, method, w, pool, card, k, ref, rollout_weights, eff)
            if placement in ("auto", "colocated"):
                out.append(_colocated(shape, method, w, card, k, ref, rollout_weights, eff))
    if not out:
        raise ValueError("no cards given")
    return out


def plan(
    shape: ModelShape,
    method: Method,
    w: Workload,
    cards: list[tuple[Card, int]],
    opts: LayoutOptions | None = None,
    *,
    objective: Objective = "cost",
    pattern: BurstPattern | None = None,
) -> Plan:
    """Every candidate layout over `cards` (within `opts`), priced; the best that fits, runners-up listed."""
    pattern = pattern or BurstPattern()
    layouts = candidates(shape, method, w, cards, opts)
    catalog = {card.name: card for card, _ in cards}
    for p in layouts:
        p.costs = price_layout(_sides(p), catalog, pattern, w) if p.fits else []
        best_mode = cheapest(p.costs)
        p.mode = best_mode.mode if best_mode else ""
        p.objective, p.pattern = objective, pattern
    renting = any(not c.owned for c in catalog.values())

    def counts(m: ModeCost) -> bool:  # with a rental listed, only options that use it compete
        return usable(m) and (m.uses_rented or not renting)

    order = sorted(layouts, key=lambda p: (not p.fits, p.step_time_s, p.roles[0].count))
    best = order[0]
    if objective == "cost":
        options = [m for p in layouts if p.fits for m in p.costs if counts(m)]
        if (top := cheapest(options)) is not None:
            best = next(p for p in order if any(m is top for m in p.costs))
            best.mode = top.mode
            cost = {id(p): min((m.cost_per_1k_steps for m in p.costs if counts(m)), default=math.inf) for p in order}
            order = sorted(order, key=lambda p: (not p.fits, cost[id(p)], p.step_time_s))
    best.comparison = []
    for mode in ("all-rented", "windowed", "backlog", "backlog+replica", "owned"):
        pick = cheapest([m for p in layouts if p.fits for m in p.costs if m.mode == mode])
        if pick is not None:
            best.comparison.append(pick)
    best.notes += _advice(best)
    owned = next((m for m in best.comparison if m.mode == "owned"), None)
    if objective == "cost" and renting and owned is not None:
        best.notes.append(
            f"without renting: {owned.layout} trains {owned.steps_per_week:,.0f} steps/week on owned cards "
            f"at ${owned.cost_per_1k_steps:.2f} per 1000 steps"
        )
    best.prices = {n: {"price_per_hour": c.price_per_hour, "owned": c.owned} for n, c in catalog.items()}
    best.alternatives = [_alternative(p) for p in order if p is not best][:5]
    if not best.fits:
        best.notes.append("nothing fits: see each role's min settings and peak, or add cards")
    return best


def _advice(p: Plan) -> list[str]:
    """What the user could trade: more steps per week for a higher cost per step, or more bursts."""
    chosen = p.chosen_cost()
    if chosen is None or chosen.cost_per_1k_steps <= 0 or p.pattern is None:
        return []
    out = []
    more = [
        m for m in p.comparison if m.mode != "owned" and usable(m) and m.steps_per_week >= 2 * chosen.steps_per_week
    ]
    if more and (m := min(more, key=lambda m: m.cost_per_1k_steps)) is not chosen:
        out.append(
            f"{m.mode} trains {m.steps_per_week / chosen.steps_per_week:.1f}x the steps per week "
            f"({m.steps_per_week:,.0f}) at {m.cost_per_1k_steps / chosen.cost_per_1k_steps - 1:+.0%} per step"
        )
    if chosen.mode == "backlog" and chosen.home_idle_share > 0.25:
        hours = math.ceil(chosen.billable_hours_per_burst * 10) / 10
        n = min(chosen.bursts_to_fill_home, int(HOURS_PER_WEEK // hours))
        hint = f"--bursts-per-week {n} --burst-hours {hours:g} would keep them busier at the same cost per step; "
        out.append(
            f"home cards idle {chosen.home_idle_share:.0%} of the week on a full backlog: "
            f"{hint if n > chosen.bursts_per_week else ''}a higher --max-lag (now {p.pattern.max_lag}) lets each "
            "burst train more"
        )
    return out


def _alternative(p: Plan) -> dict[str, object]:
    m = p.chosen_cost()
    return {
        "placement": p.placement,
        "fits": p.fits,
        "step_time_s": p.step_time_s,
        "layout": p.layout,
        "mode": p.mode,
        "cost_per_1k_steps": m.cost_per_1k_steps if m else None,
        "steps_per_week": m.steps_per_week if m else None,
        "costs": [c.model_dump() for c in p.costs],
    }
