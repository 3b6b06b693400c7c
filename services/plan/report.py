"""Render a `Plan` (from `placement.plan`) as rich tables for people, JSON for scripts, or the
environment lines of each role's service (`--emit env`)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from services.plan import vocabulary
from services.plan.placement import Plan
from services.plan.pricing import ModeCost
from services.plan.roles import RolePlan

MODE_LABEL = {
    "all-rented": "(a) all-rented",
    "windowed": "(b) windowed",
    "backlog": "(c) backlog",
    "backlog+replica": "(c') backlog+replica",
    "owned": "owned only",
}
# What each way means, printed under the cost table.
MODE_MEANING = {
    "all-rented": "every role on the rented card(s), colocated, in bursts",
    "windowed": "today's split: the rented trainer waits for the home cards, billed while waiting",
    "backlog": "home cards fill a backlog around the clock; a burst drains it, then ends",
    "backlog+replica": "(c), then a rollout replica shares the rented card until the burst's window closes",
    "owned": "no rental: owned cards around the clock",
}


def _settings(d: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "-"


def _secs(t: float) -> str:
    return "-" if not math.isfinite(t) else f"{t:.1f} s" if t < 120 else f"{t / 60:.1f} min"


def _row(r: RolePlan) -> list[str]:
    fits = "[green]yes[/]" if r.fits else "[red]NO[/]"
    mb = f"{r.micro_batch} (max {r.max_micro_batch})" if r.role != "rollout" else f"{r.micro_batch} in flight"
    return [
        r.role,
        f"{r.count}x {r.card}",
        fits,
        f"{r.peak_gb:.1f} / {r.capacity_gb:.1f}",
        f"{r.headroom_gb:+.1f}",
        mb,
        f"{r.min_peak_gb:.1f}",
        _secs(r.time_s),
    ]


def _cost_rows(plan: Plan) -> list[ModeCost]:
    """The recommended layout's own ways of running, then the best layout of each way where
    that is another layout (e.g. the cheapest windowed split puts the ref elsewhere)."""
    own = list(plan.costs)
    mine = {(m.mode, m.layout) for m in own}
    return own + [m for m in plan.comparison if (m.mode, m.layout) not in mine]


def render_costs(plan: Plan, console: Console) -> None:
    p = plan.pattern
    if p is None or not plan.costs:
        return
    prices = "; ".join(
        f"{n} {'owned' if v['owned'] else 'rented'} ${v['price_per_hour']:.2f}/h" for n, v in plan.prices.items()
    )
    console.print(
        f"costs: {prices}. Bursts of at most {p.burst_hours:g} h, at most {p.bursts_per_week}/week "
        f"(duty cycle ≤ {p.duty_cycle:.1%}), start-up {p.startup_minutes:g} min, teardown {p.teardown_minutes:g} min, max lag {p.max_lag} versions"
    )
    table = Table(title_justify="left")
    for col in ["way", "$/1k steps", "rented h/1k", "steps/wk", "lag", "home g/h", "rent g/h"]:
        table.add_column(col, overflow="fold")
    rows = _cost_rows(plan)
    for m in rows:
        mark = "* " if m is plan.chosen_cost() else ""
        if not m.available or not m.within_limit:
            table.add_row(mark + MODE_LABEL[m.mode], "-", "-", "-", "-", "-", "-")
            continue
        table.add_row(
            mark + MODE_LABEL[m.mode],
            f"{m.cost_per_1k_steps:.2f}",
            f"{m.rented_hours_per_1k_steps:.2f}",
            f"{m.steps_per_week:,.0f}",
            f"{m.lag_max}",
            f"{m.home_groups_per_h:,.0f}",
            f"{m.rented_groups_per_h:,.0f}",
        )
    console.print(table)
    console.print("  g/h: groups per hour; lag: policy versions the stalest trained group lags")
    for m in rows:
        why = f" [red]{m.why_not}[/]" if m.why_not else ""
        console.print(f"  {MODE_LABEL[m.mode]}: {MODE_MEANING[m.mode]}; {m.layout}{why}")
    if (m := plan.chosen_cost()) is not None:
        console.print(f"recommended: {MODE_LABEL[m.mode]} on {m.layout}")
        console.print(f"  {cadence(m)}")


def cadence(m: ModeCost) -> str:
    """The recommended burst cadence, backlog and staleness, in one sentence."""
    if m.mode == "owned":
        return f"runs around the clock: {m.steps_per_week:,.0f} steps/week, nothing rented"
    text = (
        f"{m.bursts_per_week:g} bursts/week of {m.billable_hours_per_burst:.2f} h billable "
        f"(rented card held {m.billable_share:.1%} of the week), {m.steps_per_week:,.0f} steps/week"
    )
    if m.mode.startswith("backlog"):
        text += (
            f"; backlog {m.backlog_groups:,.0f} groups = {m.backlog_gb:.2f} GB at burst start, "
            f"lag ≤ {m.lag_max} versions (mean ≈ {m.lag_mean:.0f}); home cards idle {m.home_idle_share:.0%} "
            "of the week on a full backlog"
        )
    if m.mode == "backlog" and m.leave_when_idle_s:
        text += (
            f"; trainer BURSTRL_TRAINER_LEAVE_WHEN_IDLE_S={m.leave_when_idle_s:g} (under the home side's "
            f"{2 * m.leave_when_idle_s:g} s per batch: a longer wait keeps a drained burst training at home's pace, billed)"
        )
    if m.mode == "backlog+replica":
        text += (
            f"; the replica takes gpu_memory_utilization={m.replica_memory_share} (what the trainer leaves "
            f"free at its peak) and {m.replica_share:.0%} of the card's time once the backlog is drained"
        )
    return text


def render(plan: Plan, console: Console | None = None) -> None:
    """Print the plan: one row per role, their settings, step time, costs, runners-up, caveats."""
    console = console or Console()
    w = plan.workload
    title = (
        f"{plan.model} ({plan.params_b:.2f}B), {plan.method}, {w.batch} prompts x G={w.group_size}, "
        f"{w.prompt_len}+{w.completion_len} tokens: [bold]{plan.placement}[/]"
    )
    table = Table(title=title, title_justify="left")
    for col in ["role", "cards", "fits", "peak / cap GB", "headroom", "micro-batch", "min GB", "time/step"]:
        table.add_column(col, overflow="fold")
    for r in plan.roles:
        table.add_row(*_row(r))
    console.print(table)
    for r in plan.roles:
        console.print(f"  {r.role} recommended: {_settings(r.recommended)}  [dim]({_settings(r.layout)})[/]")
        console.print(f"  {r.role} min:         {_settings(r.min_settings)}  [dim]({_settings(r.min_layout)})[/]")
    verdict = "[green]fits[/]" if plan.fits else "[red]does not fit[/]"
    console.print(f"{verdict}; step ≈ {_secs(plan.step_time_s)} ({plan.placement})")
    for note in [n for r in plan.roles for n in r.notes] + plan.notes:
        console.print(f"  • {note}")
    render_costs(plan, console)
    if plan.alternatives:
        console.print(f"runners-up (by {plan.objective}):")
        for alt in plan.alternatives:
            ok = "fits" if alt["fits"] else "no fit"
            cost = (
                f"${alt['cost_per_1k_steps']:.2f}/1k steps ({alt['mode']})"
                if alt["cost_per_1k_steps"] is not None
                else ""
            )
            console.print(
                f"  {alt['placement']:<14} {ok:<7} {_secs(float(alt['step_time_s'])):>9}  {cost}  {alt['layout']}"
            )
    console.print("[dim]where the numbers come from:[/]")
    for what, how in plan.provenance.items():
        console.print(f"[dim]  {what}: {how}[/]")


def to_json(plan: Plan) -> str:
    """JSON with the same fields as `Plan`; infinite times become null."""
    return plan.model_dump_json(indent=2)


def env_text(plan: Plan, profile: str = "recommended") -> str:
    """The environment of each role's service, grouped per role, ready for a .env file.

    A role on cards without bf16 (gfx906) runs behind the fork's vLLM container, which the
    rollout service reaches as a remote engine; its engine settings are `vllm serve` flags.
    """
    lines: list[str] = []
    seen: set[str] = set()
    for r in plan.roles:
        if r.role in seen:  # a second rollout group: its settings are per card type, say so
            lines.append(f"# [env.{r.role}] on {r.count}x {r.card}: a separate deployment")
        seen.add(r.role)
        settings: dict[str, Any] = dict(r.recommended if profile == "recommended" else r.min_settings)
        facts = r.layout if profile == "recommended" else r.min_layout
        lines.append(f"# [env.{r.role}] {r.count}x {r.card} ({_settings(facts)})")
        if facts.get("engine") == "remote":
            flags = vocabulary.serve_flags(settings)
            settings = {"engine": "remote"}  # the rest are the server's, or hf-engine settings
            if flags:
                lines.append("# remote engine (gfx906 fork container): vllm serve " + " ".join(flags))
        lines += [f"{k}={vocabulary.env_value(v)}" for k, v in vocabulary.env_vars(r.role, settings).items()]
        lines.append("")
    return "\n".join(lines)
