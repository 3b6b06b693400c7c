"""`burstrl plan` / `python -m services.plan`: will GRPO on this model fit on these cards?

Parses arguments into a `ModelShape` (model_shape.py), `Method`/`Workload` (memory.py) and
cards (catalog.py), calls `placement.plan`, and prints it with `report.py`. No torch import:
the answer is arithmetic, so it returns instantly on any machine.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from services.plan.catalog import Catalog, parse_card_spec
from services.plan.memory import WEIGHT_BYTES, Method, Workload
from services.plan.model_shape import BUILTIN_SHAPES, resolve_shape
from services.plan.placement import Efficiency, plan
from services.plan.report import render, to_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="burstrl plan",
        description="Estimate memory, placement, settings and step time for GRPO on given cards.",
        epilog="example: burstrl plan --model Qwen/Qwen2.5-1.5B --cards h200 mi50-32:3 --batch 32 --group-size 8",
    )
    p.add_argument(
        "--model",
        default="Qwen2.5-0.5B",
        help="config.json, model folder, cached hub id or built-in",
    )
    p.add_argument("--method", choices=["lora", "full"], default="lora")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=1024)
    p.add_argument("--group-size", "-G", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="prompts (groups) per optimizer step")
    p.add_argument("--cards", nargs="+", default=["h200"], help="e.g. h200 mi50-32:3 rtx4070")
    p.add_argument("--cards-file", help="TOML/JSON with extra [cards.<name>] entries")
    p.add_argument("--placement", choices=["auto", "disaggregated", "colocated"], default="auto")
    p.add_argument(
        "--no-ref",
        action="store_true",
        help="no KL term and no teacher: skip the ref role",
    )
    p.add_argument(
        "--rollout-weights",
        choices=sorted(WEIGHT_BYTES),
        help="force the serving precision",
    )
    p.add_argument("--mfu", type=float, default=0.4, help="fraction of peak FLOPS reached")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--list-cards", action="store_true", help="print the card catalog and exit")
    return p


def _list_cards(catalog: Catalog, console: Console) -> None:
    table = Table(title="cards")
    for col in [
        "name",
        "memory GB",
        "bf16 TFLOPS",
        "fp16 TFLOPS",
        "bandwidth GB/s",
        "link GB/s",
        "note",
    ]:
        table.add_column(col)
    for c in catalog.cards.values():
        table.add_row(
            c.name,
            f"{c.memory_gb:g}",
            f"{c.bf16_tflops:g}",
            f"{c.fp16_tflops:g}",
            f"{c.bandwidth_gbs:g}",
            f"{c.link_gbs:g}",
            c.note,
        )
    console.print(table)
    console.print("built-in models: " + ", ".join(s.name for s in BUILTIN_SHAPES.values()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        catalog = Catalog()
        if args.cards_file:
            catalog = catalog.extend_from_file(args.cards_file)
        if args.list_cards:
            _list_cards(catalog, console)
            return 0
        shape = resolve_shape(args.model)
        cards = [parse_card_spec(spec, catalog) for spec in args.cards]
        method = Method(kind=args.method, rank=args.rank)
        workload = Workload(
            prompt_len=args.prompt_len,
            completion_len=args.completion_len,
            group_size=args.group_size,
            batch=args.batch,
        )
    except (
        KeyError,
        FileNotFoundError,
        ValueError,
    ) as exc:  # bad input: say which, no traceback
        print(f"burstrl plan: {exc}", file=sys.stderr)
        return 2
    result = plan(
        shape,
        method,
        workload,
        cards,
        placement=args.placement,
        ref=not args.no_ref,
        rollout_weights=args.rollout_weights,
        eff=Efficiency(mfu=args.mfu),
    )
    if args.json:
        print(to_json(result))
    else:
        render(result, console)
    return 0 if result.fits else 1
