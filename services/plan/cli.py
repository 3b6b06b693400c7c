"""`burstrl plan` / `python -m services.plan`: will GRPO on this model fit on these cards, and
what does it cost?

Parses arguments into a `ModelShape` (model_shape.py), `Method`/`Workload` (memory.py), cards
with prices (catalog.py) and a `BurstPattern` (pricing.py), calls `placement.plan`, and prints
it with `report.py`. No torch import: the answer is arithmetic, so it returns instantly on any
machine. Bad input exits 2 with one line naming the flag and what to use instead.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

from rich.console import Console
from rich.table import Table

from services.plan.catalog import Catalog, parse_card_spec
from services.plan.memory import WEIGHT_BYTES, Method, Workload
from services.plan.model_shape import BUILTIN_SHAPES, resolve_shape
from services.plan.placement import LayoutOptions, plan
from services.plan.pricing import DEFAULT_MAX_LAG, HOURS_PER_WEEK, BurstPattern
from services.plan.report import env_text, render, to_json
from services.plan.roles import Efficiency


class UsageError(ValueError):
    """Bad input: the message names the flag and what to use instead."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every other bad input here
        print(f"burstrl plan: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="burstrl plan",
        description="Estimate memory, placement, settings, step time and rented cost for GRPO on given cards.",
        epilog="example: burstrl plan --model Qwen/Qwen2.5-1.5B --cards h200 mi50-32:3 --batch 32 --group-size 8",
    )
    p.add_argument("--model", default="Qwen2.5-0.5B", help="config.json, model folder, cached hub id or built-in")
    p.add_argument("--method", choices=["lora", "full"], default="lora")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=1024)
    p.add_argument("--group-size", "-G", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="prompts (groups) per optimizer step")
    p.add_argument("--cards", nargs="+", default=["h200"], help="e.g. h200 mi50-32:3 rtx4070")
    p.add_argument("--cards-file", help="TOML/JSON with extra [cards.<name>] entries")
    p.add_argument("--placement", choices=["auto", "disaggregated", "colocated"], default="auto")
    p.add_argument("--no-ref", action="store_true", help="no KL term and no teacher: skip the ref role")
    p.add_argument("--rollout-weights", choices=sorted(WEIGHT_BYTES), help="force the serving precision")
    p.add_argument("--mfu", default="0.4", help="fraction of peak FLOPS reached, in (0, 1]")
    cost = p.add_argument_group("cost (issue 20): what the rented card costs per trained step")
    cost.add_argument(
        "--objective",
        choices=["cost", "time"],
        default="cost",
        help="cost: cheapest per trained step within --max-lag (default); time: fastest step",
    )
    cost.add_argument("--price", nargs="+", action="extend", default=[], metavar="CARD=USD", help="USD per card-hour")
    cost.add_argument("--owned", nargs="+", action="extend", default=[], metavar="CARD", help="cards you own")
    cost.add_argument("--rented", nargs="+", action="extend", default=[], metavar="CARD", help="cards you rent")
    cost.add_argument("--burst-hours", default="10", help="longest rental session, hours (default 10)")
    cost.add_argument("--bursts-per-week", help="most sessions per week (default 3)")
    cost.add_argument("--duty-cycle", help="instead of --bursts-per-week: share of the week you may rent, (0, 1]")
    cost.add_argument("--startup-minutes", default="5", help="billable minutes per burst before training")
    cost.add_argument(
        "--teardown-minutes", default="1", help="billable minutes per burst after training (drain wait, exit)"
    )
    cost.add_argument(
        "--max-lag",
        default=str(DEFAULT_MAX_LAG),
        help=f"staleness limit in policy versions (default {DEFAULT_MAX_LAG}: measured on SmolLM2, docs/plan.md)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--emit", choices=["table", "json", "env"], default="table", help="env: each role's variables")
    out.add_argument("--json", action="store_true", help="same as --emit json")
    out.add_argument("--profile", choices=["recommended", "min"], default="recommended", help="settings for --emit env")
    out.add_argument("--list-cards", action="store_true", help="print the card catalog and exit")
    return p


def _number(flag: str, text: str, hint: str, *, integer: bool = False) -> float:
    """A finite number (whole if `integer`), or a UsageError naming `flag`."""
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a {'whole ' if integer else ''}number: {hint}") from None
    if not math.isfinite(value):
        raise UsageError(f"{flag} {text}: must be a finite number: {hint}")
    return value


def _prices(specs: list[str]) -> dict[str, float]:
    hint = "use CARD=USD_PER_HOUR with a price >= 0 (0 for a card you own), e.g. --price h200=3.5"
    out: dict[str, float] = {}
    for spec in specs:
        card, sep, text = spec.partition("=")
        if not sep or not card.strip():
            raise UsageError(f"--price {spec!r}: {hint}")
        value = _number(f"--price {card}=", text, hint)
        if value < 0:
            raise UsageError(f"--price {spec}: a price cannot be negative: {hint}")
        out[card.strip()] = value
    return out


def burst_pattern(args: argparse.Namespace) -> BurstPattern:
    """The burst flags, checked one by one so each error names its flag."""
    hours = _number("--burst-hours", args.burst_hours, "use hours per session in (0, 168], e.g. --burst-hours 10")
    if not 0 < hours <= HOURS_PER_WEEK:
        raise UsageError(f"--burst-hours {args.burst_hours}: use hours per session in (0, 168], e.g. --burst-hours 10")
    if args.bursts_per_week is not None and args.duty_cycle is not None:
        raise UsageError("--bursts-per-week and --duty-cycle say the same thing: give one of them")
    most = int(HOURS_PER_WEEK // hours)
    if args.duty_cycle is not None:
        hint = "use the share of the week you may rent, in (0, 1], e.g. --duty-cycle 0.25"
        duty = _number("--duty-cycle", args.duty_cycle, hint)
        if not 0 < duty <= 1:
            raise UsageError(f"--duty-cycle {args.duty_cycle}: {hint}")
        bursts = int(duty * HOURS_PER_WEEK / hours + 1e-9)
        if bursts < 1:
            need = hours / HOURS_PER_WEEK
            raise UsageError(
                f"--duty-cycle {args.duty_cycle} is {duty * HOURS_PER_WEEK:.1f} h a week, less than one "
                f"{hours:g} h burst: use --duty-cycle {math.ceil(need * 1000) / 1000:g} or more, or shorter --burst-hours"
            )
    else:
        hint = f"use a whole number of sessions per week from 1 to {most} (with --burst-hours {hours:g})"
        bursts = int(_number("--bursts-per-week", args.bursts_per_week or "3", hint, integer=True))
        if bursts < 1:
            raise UsageError(f"--bursts-per-week {bursts}: {hint}")
        if bursts * hours > HOURS_PER_WEEK:
            raise UsageError(
                f"--bursts-per-week {bursts} x --burst-hours {hours:g} is {bursts * hours:g} h, more than a "
                f"week (168 h): {hint}"
            )
    hint = f"use minutes >= 0 and under the {hours:g} h burst, e.g. --startup-minutes 5"
    startup = _number("--startup-minutes", args.startup_minutes, hint)
    if not 0 <= startup < hours * 60:
        raise UsageError(f"--startup-minutes {args.startup_minutes}: {hint}")
    hint = f"use minutes >= 0 that, with --startup-minutes {startup:g}, fit in the {hours:g} h burst, e.g. 1"
    teardown = _number("--teardown-minutes", args.teardown_minutes, hint)
    if not 0 <= teardown < hours * 60 - startup:
        raise UsageError(f"--teardown-minutes {args.teardown_minutes}: {hint}")
    hint = f"use policy versions >= 1, e.g. --max-lag {DEFAULT_MAX_LAG} (the default) or --max-lag 64"
    lag = int(_number("--max-lag", args.max_lag, hint, integer=True))
    if lag < 1:
        raise UsageError(f"--max-lag {args.max_lag}: {hint}")
    return BurstPattern(
        burst_hours=hours, bursts_per_week=bursts, startup_minutes=startup, teardown_minutes=teardown, max_lag=lag
    )


def _list_cards(catalog: Catalog, console: Console) -> None:
    table = Table(title="cards")
    for col in ["name", "memory GB", "bf16 TFLOPS", "fp16 TFLOPS", "bandwidth GB/s", "link GB/s", "$/h", "note"]:
        table.add_column(col)
    for c in catalog.cards.values():
        table.add_row(
            c.name,
            f"{c.memory_gb:g}",
            f"{c.bf16_tflops:g}",
            f"{c.fp16_tflops:g}",
            f"{c.bandwidth_gbs:g}",
            f"{c.link_gbs:g}",
            "owned" if c.owned else f"{c.price_per_hour:.2f}",
            c.note,
        )
    console.print(table)
    console.print("built-in models: " + ", ".join(s.name for s in BUILTIN_SHAPES.values()))


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a one-line usage error (2)
        return int(exc.code or 0)
    console = Console()
    try:
        catalog = Catalog()
        if args.cards_file:
            catalog = catalog.extend_from_file(args.cards_file)
        catalog = catalog.with_costs(_prices(args.price), args.owned, args.rented)
        if args.list_cards:
            _list_cards(catalog, console)
            return 0
        pattern = burst_pattern(args)
        mfu = _number("--mfu", args.mfu, "use a fraction of peak FLOPS in (0, 1], e.g. --mfu 0.4")
        if not 0 < mfu <= 1:
            raise UsageError(f"--mfu {args.mfu}: use a fraction of peak FLOPS in (0, 1], e.g. --mfu 0.4")
        shape = resolve_shape(args.model)
        cards = [parse_card_spec(spec, catalog) for spec in args.cards]
        method = Method(kind=args.method, rank=args.rank)
        workload = Workload(
            prompt_len=args.prompt_len,
            completion_len=args.completion_len,
            group_size=args.group_size,
            batch=args.batch,
        )
    except (KeyError, FileNotFoundError, ValueError) as exc:  # bad input: say which, no traceback
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"burstrl plan: {message}".splitlines()[0], file=sys.stderr)
        return 2
    result = plan(
        shape,
        method,
        workload,
        cards,
        LayoutOptions(
            placement=args.placement, ref=not args.no_ref, rollout_weights=args.rollout_weights, eff=Efficiency(mfu=mfu)
        ),
        objective=args.objective,
        pattern=pattern,
    )
    emit = "json" if args.json else args.emit
    if emit == "json":
        print(to_json(result))
    elif emit == "env":
        print(env_text(result, args.profile))
    else:
        render(result, console)
    return 0 if result.fits else 1
