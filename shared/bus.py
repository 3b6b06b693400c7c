"""The trajectory bus: Redis streams read through consumer groups.

Guarantees (docs/architecture.md, invariants 2, 3, 8):
- a middle stage forwards with `forward()`: XACK upstream, then XADD downstream and the
  ledger counters, in one server-side script, so an entry is either handed on and
  acknowledged, or neither (a crash in between leaves it pending, to be reclaimed and
  redone) — and only by the consumer whose XACK removed it from the pending list, so a
  slow consumer presumed dead cannot hand an entry on twice (`settle()`);
- entries left pending by a dead consumer are reclaimed with XAUTOCLAIM once idle
  longer than the slowest handler (`claim_idle_ms`); a consumer that keeps entries pending
  across reads (the trainer, until its checkpoint) claims only other consumers' entries, never
  its own, which it holds on purpose (a delivery counted each pass dead-lettered them);
- an entry delivered more than `max_deliveries` times, or one that does not decode,
  goes to the job's dead-letter stream with its reason, and the stage carries on;
- `trim_acked()` deletes only entries every group has acknowledged, so Redis memory is
  bounded by the in-flight window, not by the length of the run;
- `leave()` takes a consumer out of its group for good (a burst-side replica whose burst
  ended): its pending entries go to a live peer, and the consumer is deleted only once it
  holds none, so nothing it was handed stays pending forever;
- `inject()` puts a group that no upstream entry carries (an agent's, docs/agents.md) on a
  stream and counts it fed, or counts it fed and dropped, once per group id, in one script;
- `spill()` moves ready entries into the backlog's disk tier (shared/backlog.py): once their
  segment is in the store, one script checks they are still pending to the spiller, XACKs
  them, bumps the ledger's `spilled` and indexes the segment, so each is spilled once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec
import redis
from redis.commands.core import Script

from shared import keys
from shared.bus_scripts import ACK_LUA, FEED_LUA, FENCED_ACK_LUA, INJECT_LUA, LEAVE_LUA, SETTLE_LUA, SPILL_LUA, TRIM_LUA
from shared.lease import Fence, LeaseLost
from shared.ledger import UnknownJob
from shared.redis_conn import is_cluster
from shared.schema import DeadLetter, Message, decode, encode_dead
from shared.slots import read_streams

log = logging.getLogger(__name__)
FIELD = b"m"  # every stream entry has one field holding the msgpack payload


@dataclass(frozen=True)
class Entry:
    stream: str
    id: str
    data: bytes

    @property
    def job_id(self) -> str:
        return keys.job_of_stream(self.stream)


@dataclass
class BusStats:
    """Seconds spent inside the bus (for the "bus share of a step" measurement)."""

    read_s: float = 0.0  # reads that found data waiting (excludes blocking for new data)
    settle_s: float = 0.0


@dataclass
class Left:
    """What `Bus.leave` did: entries handed to peers, entries still held (no live peer: taken
    by the next reader), and groups left (the consumer deleted)."""

    handed: int = 0
    held: int = 0
    left: int = 0


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


M = TypeVar("M", bound=Message)


class _Carrier(Protocol):
    @property
    def data(self) -> bytes: ...  # what was sent: a message's bytes


C = TypeVar("C", bound=_Carrier)


def decode_each(items: Iterable[C], expected: type[M], dead_letter: Callable[[C, str], None]) -> list[tuple[C, M]]:
    """Each item (a stream entry, a backlog group) with its `data` decoded as `expected`; one that
    does not decode is handed to `dead_letter` with the reason (docs/architecture.md, invariant 8)
    and the rest carry on."""
    out: list[tuple[C, M]] = []
    for item in items:
        try:
            out.append((item, decode(item.data, expected)))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as err:
            dead_letter(item, f"undecodable {expected.__name__}: {err}")
    return out


class Bus:
    def __init__(
        self,
        r: redis.Redis,
        group: str,
        consumer: str,
        *,
        claim_idle_ms: int = 120_000,
        max_deliveries: int = 5,
        redo_own_pending: bool = True,
        heartbeat_role: str | None = None,
        owner_prefix: str = "",
    ) -> None:
        """`redo_own_pending`: this consumer holds no entry between reads (it handles and
        settles each batch before reading again), so any entry still pending to it at
        read time lost its output — e.g. a Redis restart from an AOF that lacked the last
        second — and is redone within seconds instead of after `claim_idle_ms`. Consumers
        that keep entries pending across reads (the trainer, until its checkpoint) pass False.

        `heartbeat_role`: the service role whose replicas are this group's consumers (the
        consumer name is the replica id): entries of a replica whose heartbeat expired are
        taken over at once (see `_take_from_gone`).

        `owner_prefix`: take over only consumers named `owner_prefix + replica id` (rollout's
        spillers in the trainer's group: never the trainer's own entries, which it trains).
        """
        self.r = r
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.redo_own_pending = redo_own_pending
        self.heartbeat_role = heartbeat_role
        self.owner_prefix = owner_prefix
        self._last_claim = 0.0
        self.stats = BusStats()
        self._settle_script = r.register_script(SETTLE_LUA)
        self._ack_script = r.register_script(ACK_LUA)
        self._fenced_ack_script = r.register_script(FENCED_ACK_LUA)
        self._spill_script = r.register_script(SPILL_LUA)
        self._leave_script = r.register_script(LEAVE_LUA)

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
        # Ask without blocking first, so `stats.read_s` measures the bus's own cost (the
        # round trip and the transfer) and not the time spent waiting for data.
        t0 = time.perf_counter()
        # On a cluster the jobs' streams are read slot by slot (shared/slots.py).
        new = {s: ">" for s in streams}
        resp = read_streams(self.r, new, count=count, block_ms=None, group=self.group, consumer=self.consumer)
        self.stats.read_s += time.perf_counter() - t0
        if not resp:
            resp = read_streams(self.r, new, count=count, block_ms=block_ms, group=self.group, consumer=self.consumer)
        for stream, entries in resp or []:
            for eid, fields in entries:
                if fields is None:  # trimmed while pending: nothing to do but ack
                    self.r.xack(stream, self.group, eid)
                    continue
                out.append(Entry(_s(stream), _s(eid), fields.get(FIELD, b"")))
        return out

    def read_own(self, stream: str, *, count: int) -> list[Entry]:
        """Entries delivered to this consumer and not yet acknowledged (its pending list).

        For a consumer that keeps entries pending across reads (the trainer, until a
        checkpoint holds them): after a restart these come back first, in stream order."""
        resp = self.r.xreadgroup(self.group, self.consumer, {stream: "0"}, count=count)
        return [Entry(_s(s), _s(eid), f.get(FIELD, b"")) for s, es in resp or [] for eid, f in es if f]

    def read_new(self, stream: str, *, count: int) -> list[Entry]:
        """Entries never delivered to this group yet, oldest first, without blocking and without
        reclaiming anyone's (the spiller: it must never take the trainer's pending entries)."""
        resp = self.r.xreadgroup(self.group, self.consumer, {stream: ">"}, count=count)
        return [Entry(_s(s), _s(eid), f.get(FIELD, b"")) for s, es in resp or [] for eid, f in es if f]

    def take_from_gone(self, stream: str, *, count: int) -> int:
        """Take over the entries of consumers (named `owner_prefix` + replica) whose heartbeat
        expired; they then come back from `read_own`. Returns how many were taken."""
        return len(self._take_from_gone(stream, count))

    def spill(self, entries: list[Entry], segment: str, index_entry: str) -> int:
        """Acknowledge ready entries whose groups are now in a stored segment, count them spilled
        and index the segment, in one script; only if every entry is still pending to this
        consumer. Returns how many were spilled (0: none, the segment is not indexed)."""
        if not entries:
            return 0
        job_id = entries[0].job_id
        stream = keys.ready(job_id)
        if any(e.stream != stream for e in entries):
            raise ValueError("spill() takes entries of one job's ready stream")
        entries = sorted(entries, key=lambda e: tuple(int(x) for x in e.id.split("-")))
        t0 = time.perf_counter()
        n = int(
            self._spill_script(
                keys=[stream, keys.ledger(job_id), keys.backlog_index(job_id)],
                args=[self.group, self.consumer, segment, index_entry, *[e.id for e in entries]],
            )
        )
        self.stats.settle_s += time.perf_counter() - t0
        if n < 0:
            log.warning(
                "segment %s not indexed: %s", segment, "an entry was taken over" if n == -1 else "indexed already"
            )
            return 0
        return n

    def decode(self, entries: Iterable[Entry], expected: type[M]) -> list[tuple[Entry, M]]:
        """Decode each entry as `expected`; one that does not decode goes to the dead-letter
        stream with the reason (docs/architecture.md, invariant 8) and the rest carry on."""
        return decode_each(entries, expected, self.dead_letter)

    def redo_now(self) -> None:
        """Run the reclaim pass (own pending entries, dead consumers') on the next read,
        e.g. after the stage's engine was away and left its entries pending."""
        self._last_claim = 0.0

    def _reclaim(self, streams: list[str], count: int) -> list[Entry]:
        now = time.monotonic()
        if now - self._last_claim < min(5.0, self.claim_idle_ms / 2000):
            return []
        self._last_claim = now
        out: list[Entry] = []
        for stream in streams:
            if not self.redo_own_pending:
                out += self._claim_from_others(stream, count)
                continue
            # Poison first: entries delivered too often go to the dead-letter stream.
            stale = self.r.xpending_range(stream, self.group, min="-", max="+", count=count, idle=self.claim_idle_ms)
            stale += self.r.xpending_range(
                stream, self.group, min="-", max="+", count=count, consumername=self.consumer
            )
            self._dead_letter_poison(stream, stale)
            # Take over a dead consumer's entries (JUSTID: no delivery counted yet), then
            # read everything pending to us — taken over, or ours with a lost output.
            # (redis-py returns just the claimed ids with JUSTID)
            taken = self.r.xautoclaim(
                stream, self.group, self.consumer, self.claim_idle_ms, "0-0", count=count, justid=True
            )
            taken += self._take_from_gone(stream, count)
            resp = self.r.xreadgroup(self.group, self.consumer, {stream: "0"}, count=count)
            mine = [Entry(stream, _s(eid), f.get(FIELD, b"")) for _, es in resp or [] for eid, f in es if f]
            if mine:
                log.warning(
                    "redoing %d pending entries (%d taken over from a dead consumer, the rest ours with a lost output)",
                    len(mine),
                    len(taken),
                )
                out += mine
        return out

    def _claim_from_others(self, stream: str, count: int) -> list[Entry]:
        """A consumer that keeps entries pending across reads (the trainer, until its checkpoint
        holds them): take over only other consumers' entries idle past claim_idle_ms.

        Its own pending entries are its own: it holds them on purpose, so claiming them from
        itself would only count a delivery each pass, and at max_deliveries the poison check
        dead-lettered groups it still held (then trained them anyway). So they are neither
        claimed nor counted here; after a restart `read_own` hands them back."""
        try:
            consumers = self.r.xinfo_consumers(stream, self.group)
        except redis.ResponseError:  # no stream or group yet
            return []
        stale = []
        for c in consumers:
            name = _s(c["name"])
            if name != self.consumer and int(c["pending"]) > 0:
                stale += self.r.xpending_range(
                    stream, self.group, min="-", max="+", count=count, consumername=name, idle=self.claim_idle_ms
                )
        stale = self._dead_letter_poison(stream, stale)
        if not stale:
            return []
        # XCLAIM re-checks the idle time: an entry its owner settled or touched meanwhile stays its own.
        got = self.r.xclaim(stream, self.group, self.consumer, self.claim_idle_ms, [p["message_id"] for p in stale])
        claimed = [Entry(stream, _s(eid), f.get(FIELD, b"")) for eid, f in got if f]
        if claimed:
            log.warning("reclaimed %d entries left by a dead consumer", len(claimed))
        return claimed

    def _dead_letter_poison(self, stream: str, pending: list) -> list:
        """Dead-letter the entries of `pending` (XPENDING rows) delivered max_deliveries times or
        more; returns the other rows."""
        rest, seen = [], set()
        for p in pending:
            if p["message_id"] in seen:  # listed twice (idle, and ours): one decision
                continue
            seen.add(p["message_id"])
            if p["times_delivered"] >= self.max_deliveries:
                self._dead_letter_id(stream, _s(p["message_id"]), p["times_delivered"])
            else:
                rest.append(p)
        return rest

    def leave(self, streams: Iterable[str], *, batch: int = 500) -> Left:
        """Leave this group for good: call once this consumer reads no more (its process is
        ending). Per stream, its pending entries go to a live peer consumer (one whose replica
        still heartbeats, named `owner_prefix` + replica), which redoes them from its own
        pending list; then the consumer is deleted from the group. With no live peer, its
        entries stay pending to it, and the first replica that reads the stream takes them at
        once, since this replica's heartbeat is gone (`_take_from_gone`): nothing is lost, and
        nothing waits out `claim_idle_ms`."""
        out = Left()
        for stream in streams:
            peer, moved = self._live_peer(stream), 0
            while True:
                handed, held, deleted = (
                    int(x) for x in self._leave_script(keys=[stream], args=[self.group, self.consumer, peer, batch])
                )
                moved += handed
                if deleted or not handed:  # done, or no peer to hand the rest to
                    out.held += held
                    out.left += bool(deleted)
                    break
            out.handed += moved
            if moved or held:
                log.info("left %s: %d pending entries handed to %s, %d still held", stream, moved, peer or "-", held)
        return out

    def _live_peer(self, stream: str) -> str:
        """Another consumer of this group whose replica heartbeats ("" when none): the fewest
        pending entries first, so the work spreads."""
        if not self.heartbeat_role:
            return ""
        try:
            consumers = self.r.xinfo_consumers(stream, self.group)
        except redis.ResponseError:  # no such stream or group
            return ""
        for c in sorted(consumers, key=lambda c: int(c["pending"])):
            name = _s(c["name"])
            if name == self.consumer or not name.startswith(self.owner_prefix):
                continue
            if self.r.exists(keys.service(self.heartbeat_role, name[len(self.owner_prefix) :])):
                return name
        return ""

    def _take_from_gone(self, stream: str, count: int) -> list:
        """Entries pending to consumers whose service heartbeat has expired: taken now.

        Consumers are named after their replica, and every service heartbeats into a key
        that expires a few beats after the process dies, so a kill -9'd replica's entries
        need not wait out `claim_idle_ms` (sized for the slowest handler, minutes). A live
        consumer mistaken for gone only loses the race to settle: settle is at most once.
        """
        if not self.heartbeat_role:
            return []
        owners = {_s(c["name"]) for c in self.r.xinfo_consumers(stream, self.group) if int(c["pending"]) > 0}
        owners.discard(self.consumer)
        taken: list = []
        for owner in owners:
            if not owner.startswith(self.owner_prefix):
                continue
            if self.r.exists(keys.service(self.heartbeat_role, owner[len(self.owner_prefix) :])):
                continue
            ids = [p["message_id"] for p in self.r.xpending_range(stream, self.group, "-", "+", count, owner)]
            if ids:  # 2 s idle at least: never snatch an entry in the middle of its delivery
                taken += self.r.xclaim(stream, self.group, self.consumer, 2000, ids, justid=True)
                log.warning("taking %d entries from %s, whose heartbeat has expired", len(ids), owner)
        return taken

    def _dead_letter_id(self, stream: str, eid: str, deliveries: int) -> None:
        got = self.r.xrange(stream, eid, eid)
        data = got[0][1].get(FIELD, b"") if got else b""
        self.dead_letter(Entry(stream, eid, data), f"delivered {deliveries} times without being handled")

    def forward(
        self,
        entries: list[Entry],
        out: list[tuple[str, bytes]],
        ledger: dict[str, dict[str, int]] | None = None,
    ) -> int:
        """Hand one entry on: XADD each output, XACK the input, bump ledger counters.

        With several entries and no outputs (a batch acknowledged together), each
        entry is settled on its own and each job's counters must split one per entry.
        Returns how many entries were settled now (not already acknowledged).
        """
        if len(entries) == 1:
            counters = (ledger or {}).get(entries[0].job_id, {})
            return self.settle([(entries[0], out, counters)])
        if out:
            raise ValueError("forward() with outputs takes exactly one input entry")
        return self.ack(entries, ledger)

    def ack(
        self, entries: list[Entry], ledger: dict[str, dict[str, int]] | None = None, *, fence: Fence | None = None
    ) -> int:
        """Acknowledge entries; `ledger` counts must be one per entry of each job (or absent).

        Counters go up by the number of entries this call actually removed from the
        pending list (XACK's own count, in the same script), so an entry acknowledged
        twice is counted once. Returns that number.

        `fence`: acknowledge only while holding that lease (the trainer's acks): checked in
        the same script, so a deposed trainer's ack fails atomically; raises LeaseLost then.
        """
        by_stream: dict[str, list[Entry]] = {}
        for e in entries:
            by_stream.setdefault(e.stream, []).append(e)
        for job_id, counters in (ledger or {}).items():
            n = sum(len(es) for es in by_stream.values() if es[0].job_id == job_id)
            for name, total in counters.items():
                if total != n:
                    raise ValueError(f"ledger counter {name}={total} for {n} entries of job {job_id}: need one each")
        if not entries:
            return 0
        t0 = time.perf_counter()
        calls: list[tuple[Script, list, list]] = []
        for stream, es in by_stream.items():
            job_id = es[0].job_id
            names = list((ledger or {}).get(job_id, {}))
            for i in range(0, len(es), 1000):  # Lua's unpack() has a stack limit of ~8000 values
                ids = [e.id for e in es[i : i + 1000]]
                if fence is None:
                    calls.append(
                        (self._ack_script, [stream, keys.ledger(job_id)], [self.group, len(names), *names, *ids])
                    )
                else:
                    calls.append(
                        (
                            self._fenced_ack_script,
                            [fence.key, stream, keys.ledger(job_id)],
                            [fence.value, self.group, len(names), *names, *ids],
                        )
                    )
        results = [int(x) for x in self._run_scripts(calls)]
        if any(x < 0 for x in results):
            # Nothing after the first refused chunk can have been acknowledged either: the
            # lease does not come back within one pipeline.
            raise LeaseLost(f"lease {fence.key if fence else ''} lost: {sum(x for x in results if x > 0)} acked first")
        done = sum(results)
        self.stats.settle_s += time.perf_counter() - t0
        if done < len(entries):
            log.warning("%d of %d entries were already acknowledged elsewhere", len(entries) - done, len(entries))
        return done

    def _run_scripts(self, calls: list[tuple[Script, list, list]]) -> list:
        """Each (script, keys, args), in order, in one round trip on a single Redis (a pipeline).
        On a cluster one call each: redis-py's cluster pipeline does not load a script that a node
        lacks (NOSCRIPT; a promoted replica has an empty script cache), the script's own call does."""
        if is_cluster(self.r):
            return [script(keys=k, args=a) for script, k, a in calls]
        pipe = self.r.pipeline(transaction=False)
        for script, k, a in calls:
            script(keys=k, args=a, client=pipe)
        return pipe.execute()

    def settle(self, units: list[tuple[Entry, list[tuple[str, bytes]], dict[str, int]]]) -> int:
        """Settle each (input entry, outputs, counters) atomically and at most once.

        One server-side script call for the whole batch (one round trip); per unit it
        XACKs the input, and only if that removed it from the pending list, XADDs the
        outputs and bumps the counters. A consumer that was presumed dead and whose entry
        was reclaimed and handled by another replica therefore cannot hand the entry on a
        second time or count it twice. Returns the units settled now.
        """
        return sum(self.settle_each(units))

    def settle_each(self, units: list[tuple[Entry, list[tuple[str, bytes]], dict[str, int]]]) -> list[bool]:
        """`settle`, saying for each unit whether it was settled now (False: already
        acknowledged elsewhere, so nothing of it was handed on or counted)."""
        if not units:
            return []
        t0 = time.perf_counter()
        # One script call per job (a job's keys share one Redis Cluster slot, shared/keys.py),
        # in one round trip on a single Redis.
        by_job: dict[str, list[int]] = {}
        for i, (e, outputs, _) in enumerate(units):
            for stream, _ in outputs:
                if keys.job_of_stream(stream) != e.job_id:
                    raise ValueError(f"settle: an entry of job {e.job_id} has an output on another job's {stream}")
            by_job.setdefault(e.job_id, []).append(i)
        calls: list[tuple[Script, list, list]] = []
        for positions in by_job.values():
            index: dict[str, int] = {}

            def k(key: str, index: dict[str, int] = index) -> int:  # 1-based position in KEYS
                return index.setdefault(key, len(index) + 1)

            args: list[bytes | str | int] = [self.group, FIELD, len(positions)]
            for i in positions:
                e, outputs, counters = units[i]
                args += [k(e.stream), e.id, k(keys.ledger(e.job_id)), len(outputs)]
                for stream, payload in outputs:
                    args += [k(stream), payload]
                args.append(len(counters))
                for name, n in counters.items():
                    args += [name, n]
            calls.append((self._settle_script, list(index), args))
        flags = [False] * len(units)
        for positions, got in zip(by_job.values(), self._run_scripts(calls), strict=True):
            for i, x in zip(positions, got, strict=True):
                flags[i] = bool(int(x))
        self.stats.settle_s += time.perf_counter() - t0
        if not all(flags):
            skipped = flags.count(False)
            log.warning("%d of %d entries were already acknowledged elsewhere; skipped", skipped, len(units))
        return flags

    def redo_or_dead_letter(self, e: Entry, reason: str) -> bool:
        """An entry this consumer failed to handle, through no fault of the service (an engine
        refused its request, say): left pending, so a later read delivers it again, until it
        has been delivered `max_deliveries` times; then dead-lettered with `reason`, which
        says more than the reclaim pass's "delivered N times". True: dead-lettered."""
        pending = self.r.xpending_range(e.stream, self.group, min=e.id, max=e.id, count=1)
        delivered = int(pending[0]["times_delivered"]) if pending else 0
        if delivered < self.max_deliveries:
            return False
        self.dead_letter(e, f"{reason} (delivered {delivered} times)")
        return True

    def dead_letter(self, e: Entry, reason: str) -> None:
        log.error("dead-lettering %s %s: %s", e.stream, e.id, reason)
        d = DeadLetter(stream=e.stream, entry_id=e.id, reason=reason, payload=e.data, at=time.time())
        self.forward([e], [(keys.dead_letter(e.job_id), encode_dead(d))], {e.job_id: {"dead": 1}})


def feed(r: redis.Redis, job_id: str, fed: int, payloads: list[bytes]) -> int:
    """Append `payloads` to the job's prompt stream and count them fed, in one script, only if
    the ledger's `fed` is still `fed` (what the caller read). Returns how many were appended: all,
    or 0 when another feeder moved `fed` first (nothing written). Raises UnknownJob, writing
    nothing, when the ledger is gone: Redis lost the job after the caller read it (the api's
    recovery puts it back from the store). Entries keep the bus's layout: one field, FIELD."""
    if not payloads:
        return 0
    got = int(r.eval(FEED_LUA, 2, keys.ledger(job_id), keys.prompts(job_id), FIELD, fed, *payloads))
    if got < 0:
        raise UnknownJob(f"no ledger for job {job_id!r} in this Redis (Redis lost its data?): nothing fed")
    return got


def inject(
    r: redis.Redis,
    job_id: str,
    group_id: str,
    outputs: list[tuple[str, bytes]],
    counters: dict[str, int],
    *,
    outcome: str,
) -> bool:
    """Hand on a group no stream entry carried here (an agent group): XADD `outputs` and bump
    `counters`, only if `group_id` has no outcome yet in the job's agent_groups hash, which
    records `outcome` in the same script. True: done now; False: it was done before, so a
    retried close (or a close racing a deadline) never counts a group twice. Raises UnknownJob,
    writing nothing, when the job's ledger is gone (Redis lost its data since the group opened)."""
    for stream, _ in outputs:
        if keys.job_of_stream(stream) != job_id:
            raise ValueError(f"inject() for job {job_id} got an output stream of another job: {stream}")
    args: list[bytes | str | int] = [FIELD, group_id, outcome, len(outputs), *[p for _, p in outputs], len(counters)]
    for name, n in counters.items():
        args += [name, n]
    got = r.eval(
        INJECT_LUA, 2 + len(outputs), keys.agent_groups(job_id), keys.ledger(job_id), *[s for s, _ in outputs], *args
    )
    if int(got) < 0:
        raise UnknownJob(
            f"no ledger for job {job_id!r} in this Redis (Redis lost its data?): group {group_id} not put on"
        )
    return bool(int(got))


def undelivered(r: redis.Redis, stream: str, group: str, *, limit: int) -> int:
    """Entries of `stream` not yet delivered to `group` (at most `limit` are counted)."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream yet
        return 0
    for g in groups:
        if _s(g.get("name", b"")) != group:
            continue
        if g.get("lag") is not None:
            return min(limit, int(g["lag"]))
        # Redis cannot tell the lag after deletions within the range: count (bounded).
        return len(r.xrange(stream, f"({_s(g['last-delivered-id'])}", "+", count=limit))
    return 0


def trim_acked(r: redis.Redis, stream: str) -> int:
    """Delete entries every group has acknowledged (Redis 7.0 has no XTRIM ... ACKED).

    Never touches a pending or undelivered entry, so Redis memory is bounded by the
    in-flight window rather than by the length of the run. A stream no group reads
    yet is left alone. Returns the number of entries removed.
    """
    removed, _ = r.eval(TRIM_LUA, 1, stream)
    return int(removed)


def trim_job(r: redis.Redis, job_id: str) -> int:
    """Trim every stage stream of a job to what is still pending or undelivered."""
    return sum(trim_acked(r, stream) for stream in keys.job_streams(job_id))
