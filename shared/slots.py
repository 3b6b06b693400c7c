"""Reading several jobs' streams at once, on one Redis or a Redis Cluster.

One XREAD / XREADGROUP may name many streams, but on a cluster all of them must hash to one
slot (CROSSSLOT otherwise), and each job's streams have their own slot (shared/keys.py). So
on a cluster the streams are read per slot: one non-blocking call per slot, and, when none
had anything, again after a short pause until the caller's block time is up (a blocking read
on one slot would sit deaf to the others). On one Redis it stays one call, blocking as asked.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from typing import Any, TypeVar

import redis

from shared.redis_conn import is_cluster

# How often a cluster reader polls its slots while it waits for data: the latency a blocked
# single-Redis read does not have, traded for one non-blocking read per slot per pause.
POLL_S = 0.05

K = TypeVar("K", bound=Hashable)


def by_slot(r: redis.Redis, streams: Iterable[K]) -> list[list[K]]:
    """`streams` grouped so each group can go in one command: all of them on one Redis, one
    group per hash slot on a cluster (in first-seen order)."""
    streams = list(streams)
    if not is_cluster(r):
        return [streams] if streams else []
    groups: dict[int, list[K]] = {}
    for s in streams:
        groups.setdefault(r.keyslot(s), []).append(s)  # type: ignore[attr-defined]
    return list(groups.values())


def read_streams(
    r: redis.Redis,
    ids: dict[Any, Any],
    *,
    count: int,
    block_ms: int | None,
    group: str | None = None,
    consumer: str | None = None,
) -> list:
    """XREADGROUP (with `group` and `consumer`) or XREAD over `ids` (stream -> id to read
    after), waiting up to `block_ms` (None or 0: not at all) for an entry when none has one.
    Returns redis-py's reply shape: [(stream, [(id, fields), ...]), ...]."""

    def once(streams: list, block: int | None) -> list:
        sub = {s: ids[s] for s in streams}
        if group is not None:
            return r.xreadgroup(group, consumer, sub, count=count, block=block) or []
        return r.xread(sub, count=count, block=block) or []

    groups = by_slot(r, ids)
    if not groups:
        return []
    if len(groups) == 1:
        return once(groups[0], block_ms or None)
    deadline = time.monotonic() + (block_ms or 0) / 1000
    while True:
        out: list = []
        for streams in groups:
            out += once(streams, None)
        left = deadline - time.monotonic()
        if out or left <= 0:
            return out
        time.sleep(min(POLL_S, left))
