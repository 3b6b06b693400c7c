"""Render a `Plan` (from `placement.plan`) as a rich table for people or JSON for scripts."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from services.plan.placement import Plan, RolePlan

# What docs/plan_calibration.md measured, repeated where people read the numbers.
ERROR_NOTE = (
    "Memory: trainer tensor bytes calibrated within ±5% on CPU (docs/plan_calibration.md); GPU context, "
    "workspaces and allocator slack are assumed (+1 GB, +5%). Times: FLOPs/bandwidth model, expect ±50%."
)


def _settings(d: dict[str, object], skip: tuple[str, ...] = ()) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if k not in skip) or "-"


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
        _settings(r.recommended, skip=("micro_batch",)),  # already in its own column
        f"{r.min_peak_gb:.1f} GB: {_settings(r.min_settings)}",
        _secs(r.time_s),
    ]


def render(plan: Plan, console: Console | None = None) -> None:
    """Print the plan: one row per role, then the step time, runners-up and caveats."""
    console = console or Console()
    w = plan.workload
    title = (
        f"{plan.model} ({plan.params_b:.2f}B), {plan.method}, {w.batch} prompts x G={w.group_size}, "
        f"{w.prompt_len}+{w.completion_len} tokens: [bold]{plan.placement}[/]"
    )
    table = Table(title=title, title_justify="left")
    for col in [
        "role",
        "cards",
        "fits",
        "peak / cap GB",
        "headroom",
        "micro-batch",
        "recommended",
        "min",
        "time/step",
    ]:
        table.add_column(col, overflow="fold")
    for r in plan.roles:
        table.add_row(*_row(r))
    console.print(table)
    verdict = "[green]fits[/]" if plan.fits else "[red]does not fit[/]"
    console.print(f"{verdict}; step ≈ {_secs(plan.step_time_s)} ({plan.placement})")
    for note in [n for r in plan.roles for n in r.notes] + plan.notes:
        console.print(f"  • {note}")
    if plan.alternatives:
        console.print("runners-up:")
        for alt in plan.alternatives:
            ok = "fits" if alt["fits"] else "no fit"
            console.print(f"  {alt['placement']:<14} {ok:<7} {_secs(float(alt['step_time_s'])):>9}  {alt['layout']}")
    console.print(f"[dim]{ERROR_NOTE}[/]")


def to_json(plan: Plan) -> str:
    """JSON with the same fields as `Plan`; infinite times become null."""
    return plan.model_dump_json(indent=2)
