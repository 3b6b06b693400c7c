"""Bus overhead: produce -> consume -> ack through shared.bus vs raw redis-py, same bytes.

Three paths move the same realistic groups (8 completions x 512 tokens, with sampler
log-probs and a loss mask) through a redis-server this script starts (AOF everysec,
as in production):
- raw:        XADD of the pre-encoded bytes, XREADGROUP, XACK — the floor any design pays;
- bus:        XADD, `Bus.read`, `Bus.ack` (the at-most-once ack script with the ledger
              counter) — what the bus itself adds;
- bus+codec:  the same plus the schema: encode each GroupMsg, decode + validate it.
Rounds alternate the paths so drift on this shared machine hits all alike; the headline
ratios (throughput / raw throughput) compare each path's best round, and the median and
spread of the per-round ratios are printed beside them. Target: bus >= 0.8.

    .venv/bin/python bench/bus.py [--groups 400] [--rounds 7] [--out bench/results/bus.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared import keys  # noqa: E402
from shared.bus import FIELD, Bus  # noqa: E402
from shared.redis_conn import connect  # noqa: E402
from shared.schema import Completion, GroupMsg, decode, encode, pack_f32, pack_i32, pack_u8  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402

G, T, BATCH = 8, 512, 8


def make_group(i: int, rng: np.random.Generator) -> GroupMsg:
    comps = [
        Completion(
            token_ids=pack_i32(rng.integers(0, 150_000, T)),
            logprobs=pack_f32(-rng.random(T)),
            loss_mask=pack_u8(np.ones(T)),
            text="x" * 1500,
            finish_reason="length",
            reward=1.0,
            reward_parts={"correct": 1.0},
        )
        for _ in range(G)
    ]
    return GroupMsg(
        job_id="bench",
        group_id=f"bench:g{i}",
        item_id=str(i),
        prompt="What is 12 + 30?",
        prompt_ids=pack_i32(rng.integers(0, 150_000, 64)),
        policy_version=1,
        completions=comps,
        stage="ready",
    )


def run_raw(r, payloads: list[bytes], stream: str) -> float:
    r.delete(stream)
    r.xgroup_create(stream, "g", id="0", mkstream=True)
    t0 = time.perf_counter()
    for p in payloads:
        r.xadd(stream, {FIELD: p})
    done = 0
    while done < len(payloads):
        resp = r.xreadgroup("g", "c", {stream: ">"}, count=BATCH)
        for s, entries in resp:
            r.xack(s, "g", *[eid for eid, _ in entries])
            done += len(entries)
    return time.perf_counter() - t0


def run_bus(r, groups: list[GroupMsg], payloads: list[bytes], job: str, *, codec: bool) -> float:
    """Through the bus; with `codec` the schema encode/decode + validation is timed too."""
    for s in keys.job_streams(job):
        r.delete(s)
    r.delete(keys.ledger(job))
    Bus.ensure_groups(r, job)
    bus = Bus(r, keys.GROUP_TRAINER, "c")
    stream = keys.ready(job)
    t0 = time.perf_counter()
    for g, p in zip(groups, payloads, strict=True):
        r.xadd(stream, {FIELD: encode(g) if codec else p})
    done = 0
    while done < len(groups):
        entries = bus.read([stream], count=BATCH, block_ms=100)
        if codec:
            for e in entries:
                decode(e.data, GroupMsg)
        bus.ack(entries, {job: {"trained": len(entries)}})
        done += len(entries)
    return time.perf_counter() - t0


def summarize(groups: int, times: dict[str, list[float]]) -> dict[str, Any]:
    """Per path: groups/s (median of rounds) and, against raw, the ratio of best rounds (the least
    disturbed run of each path, the usual estimate of a path's own cost on a shared machine) with
    the per-round pairs' median and spread."""
    out: dict[str, Any] = {}
    for name, ts in times.items():
        pairs = [raw / x for raw, x in zip(times["raw"], ts, strict=True)]
        out[name] = {
            "groups_per_s": groups / statistics.median(ts),
            "vs_raw": min(times["raw"]) / min(ts),
            "pairs_median": statistics.median(pairs),
            "pairs_min": min(pairs),
            "pairs_max": max(pairs),
        }
    return out


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: the bus and the bus with the schema against raw redis-py."""
    s, raw = res["summary"], res["summary"]["raw"]["groups_per_s"]
    return [
        figure(
            f"{what} / raw redis-py throughput, best rounds",
            f"{s[path]['groups_per_s']:.0f} groups/s (median)",
            baseline=f"raw {raw:.0f} groups/s (median)",
            ratio=s[path]["vs_raw"],
            target=target,
        )
        for path, what, target in (("bus", "bus", ">= 0.8"), ("bus+codec", "bus + msgpack schema", None))
    ]


def report(a: argparse.Namespace, cmd: str, per_mb: float, s: dict[str, Any]) -> str:
    def row(label: str, path: str) -> str:
        x = s[path]
        return (
            f"| {label} | {x['groups_per_s']:.0f} | {x['groups_per_s'] * per_mb:.0f} | **{x['vs_raw']:.2f}** | "
            f"{x['pairs_median']:.2f} [{x['pairs_min']:.2f}, {x['pairs_max']:.2f}] |"
        )

    raw = s["raw"]["groups_per_s"]
    lines = [
        "## Bus overhead (issue 3)",
        "",
        f"`{cmd}` — {a.groups} groups of {G} x {T} tokens ({per_mb * 1000:.0f} kB each), {a.rounds} rounds "
        "alternating the three paths, redis-server with AOF everysec on loopback, consumer batches of 8.",
        "",
        "| path | groups/s (median) | MB/s | vs raw (best rounds) | per-round pairs: median [min, max] |",
        "|---|---|---|---|---|",
        f"| raw redis-py: XADD, XREADGROUP, XACK | {raw:.0f} | {raw * per_mb:.0f} | 1.00 | |",
        row("bus: XADD, `Bus.read`, `Bus.ack` (at-most-once script + ledger)", "bus"),
        row("bus + schema: encode, read, decode + validate, ack", "bus+codec"),
        "",
        "Target: bus >= 0.8 of raw. The schema row adds msgpack encode + typed decode of every group, "
        "which raw bytes skip but any real producer and consumer pay. The machine is shared: the "
        "per-round spread is other load.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="The page (and its .json beside it); default: stdout only.")
    a = ap.parse_args()
    cmd = shown_command(__file__)
    with tempfile.TemporaryDirectory(prefix="bench-bus-") as tmp:
        srv = RedisServer(Path(tmp))  # AOF everysec, as in production
        srv.start()
        try:
            r = connect(srv.url)
            rng = np.random.default_rng(0)
            groups = [make_group(i, rng) for i in range(a.groups)]
            payloads = [encode(g) for g in groups]
            times: dict[str, list[float]] = {"raw": [], "bus": [], "bus+codec": []}
            for k in range(a.rounds + 1):  # round 0 warms every path up and is not counted
                t = {
                    "raw": run_raw(r, payloads, "bench:raw"),
                    "bus": run_bus(r, groups, payloads, "bench", codec=False),
                    "bus+codec": run_bus(r, groups, payloads, "bench", codec=True),
                }
                if k:
                    for name, v in t.items():
                        times[name].append(v)
        finally:
            srv.kill()
    per_mb = sum(map(len, payloads)) / 1e6 / a.groups
    summary = summarize(a.groups, times)
    data = {"groups": a.groups, "rounds": a.rounds, "mb_per_group": per_mb, "times": times, "summary": summary}
    emit(report(a, cmd, per_mb, summary), a.out, data, figures=figures(data), command=cmd)


if __name__ == "__main__":
    main()
