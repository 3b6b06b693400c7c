"""The trajectory bus: Redis streams read through consumer groups.

Guarantees (ARCHITECTURE invariants 2, 3, 8):
- a middle stage forwards with `forward()`: XADD downstream + XACK upstream + ledger
  counters in one MULTI/EXEC, so an entry is either handed on and acknowledged, or
  neither (a crash in between leaves it pending, to be reclaimed and redone);
- entries left pending by a dead consumer are reclaimed with XAUTOCLAIM once idle
  longer than the slowest handler (`claim_idle_ms`);
- an entry delivered more than `max_deliveries` times, or one that does not decode,
  goes to the job's dead-letter stream with its reason, and the stage carries on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from shared import keys
from shared.schema import DeadLetter, encode_dead

log = logging.getLogger(__name__)
FIELD = b"m"  # every stream entry has one field holding the msgpack payload


@dataclass(frozen=True)
class Entry:
    stream: str
    id: str
    data: bytes

    @property
    def job_id(self) -> str:
        return self.stream.split(":")[1]


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class Bus:
    def __init__(
        self,
        r: redis.Redis,
        group: str,
        consumer: str,
        *,
        claim_idle_ms: int = 120_000,
        max_deliveries: int = 5,
    ) -> None:
        self.r = r
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self._last_claim = 0.0

    @staticmethod
    def ensure_groups(r: redis.Redis, job_id: str) -> None:
        """Create every stage's consumer group for a job (idempotent)."""
        for stream, group in keys.job_streams(job_id).items():
            try:
                r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def read(self, streams: Iterable[str], *, count: int, block_ms: int) -> list[Entry]:
        """New entries for this group, after reclaiming any left by dead consumers."""
        streams = list(streams)
        if not streams:
            time.sleep(block_ms / 1000)
            return []
        out = self._reclaim(streams, count)
        if out:
            return out
        resp = self.r.xreadgroup(self.group, self.consumer, {s: ">" for s in streams}, count=count, block=block_ms)
        for stream, entries in resp or []:
            for eid, fields in entries:
                if fields is None:  # trimmed while pending: nothing to do but ack
                    self.r.xack(stream, self.group, eid)
                    continue
                out.append(Entry(_s(stream), _s(eid), fields.get(FIELD, b"")))
        return out

    def _reclaim(self, streams: list[str], count: int) -> list[Entry]:
        now = time.monotonic()
        if now - self._last_claim < min(5.0, self.claim_idle_ms / 2000):
            return []
        self._last_claim = now
        out: list[Entry] = []
        for stream in streams:
            # Poison first: entries delivered too often go to the dead-letter stream.
            for p in self.r.xpending_range(stream, self.group, min="-", max="+", count=count, idle=self.claim_idle_ms):
                if p["times_delivered"] >= self.max_deliveries:
                    eid = _s(p["message_id"])
                    got = self.r.xrange(stream, eid, eid)
                    data = got[0][1].get(FIELD, b"") if got else b""
                    self.dead_letter(
                        Entry(stream, eid, data),
                        f"delivered {p['times_delivered']} times without being handled",
                    )
            _, claimed, _ = self.r.xautoclaim(stream, self.group, self.consumer, self.claim_idle_ms, "0-0", count=count)
            for eid, fields in claimed:
                if fields:
                    out.append(Entry(stream, _s(eid), fields.get(FIELD, b"")))
        if out:
            log.warning("reclaimed %d entries left by a dead consumer", len(out))
        return out

    def forward(
        self,
        entries: list[Entry],
        out: list[tuple[str, bytes]],
        ledger: dict[str, dict[str, int]] | None = None,
    ) -> None:
        """Atomically: XADD each (stream, payload), XACK the inputs, bump ledger counters."""
        pipe = self.r.pipeline(transaction=True)
        for stream, payload in out:
            pipe.xadd(stream, {FIELD: payload})
        for e in entries:
            pipe.xack(e.stream, self.group, e.id)
        for job_id, counters in (ledger or {}).items():
            for name, n in counters.items():
                pipe.hincrby(keys.ledger(job_id), name, n)
        pipe.execute()

    def ack(self, entries: list[Entry], ledger: dict[str, dict[str, int]] | None = None) -> None:
        self.forward(entries, [], ledger)

    def dead_letter(self, e: Entry, reason: str) -> None:
        log.error("dead-lettering %s %s: %s", e.stream, e.id, reason)
        d = DeadLetter(stream=e.stream, entry_id=e.id, reason=reason, payload=e.data, at=time.time())
        self.forward([e], [(keys.dead_letter(e.job_id), encode_dead(d))], {e.job_id: {"dead": 1}})
