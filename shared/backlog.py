"""The backlog's disk tier: its segment index, and the budget that bounds it.

docs/architecture.md, invariants 2-4. A job with a backlog keeps generating while no trainer
holds it. Redis keeps a hot window of the ready stream; beyond it, rollout's spiller
(services/rollout/spill.py) moves groups into the object store:

- a segment is an immutable, checksummed folder jobs/{job}/backlog/{seg}/, manifest last
  (shared/segments.py);
- the segment index (keys.backlog_index) names the segments a trainer may take groups from,
  each with how many are `remaining`. A segment enters it in the same server-side script that
  acknowledges its stream entries and bumps the ledger's `spilled` (shared/bus.py, Bus.spill):
  a crash before that script leaves the entries pending (they are spilled again, into a new
  segment) and the first segment an orphan nobody trains, deleted later by age;
- a group leaves a segment through `mark_done`, one script that sets the group's bit in the
  segment's done bitmap, and only if it was not set yet, bumps the ledger (trained,
  dropped_age, dead, ...) and decrements `remaining`, removing the index entry at 0. The
  trainer calls it, fenced by its lease, once the checkpoint holding the group's gradient is
  stored; so a segment's groups are acknowledged the way stream entries are, each exactly once.

shared.ledger.audit() counts the `remaining` of every indexed segment as in flight. The feeder
and rollout's /readyz share one budget rule (`feed_room`); docs/backlog.md has the whole design.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from shared import keys
from shared.bus import FIELD
from shared.job import JobRecord, JobSpec
from shared.lease import Fence, LeaseLost
from shared.segments import SegmentInfo, delete_segment
from shared.store import FileStore, ObjectStore


# -- the index -------------------------------------------------------------------------
def read_index(r: redis.Redis, job_id: str) -> dict[str, SegmentInfo]:
    """Indexed segments, oldest first."""
    raw = r.hgetall(keys.backlog_index(job_id))
    return {k.decode(): SegmentInfo.from_json(v) for k, v in sorted(raw.items())}


def done_positions(r: redis.Redis, job_id: str, seg: str, n: int) -> set[int]:
    """Positions of a segment whose group already left the backlog (its done bitmap)."""
    bits = r.get(keys.backlog_done(job_id, seg)) or b""
    return {i for i in range(min(n, 8 * len(bits))) if bits[i // 8] >> (7 - i % 8) & 1}


# KEYS: lease, index, done bitmap, ledger, dead stream. ARGV: the lease value ('' to act only
# while no trainer holds the lease: rollout expiring aged segments), segment, counter ('' for
# none), field, n, positions..., then n dead-letter payloads when counter is 'dead'. Each
# position counts once (its bit goes 0 -> 1). Returns {groups marked now, 1 if the segment is
# finished (index entry removed, its bytes off the ledger's backlog_bytes; or already gone)};
# {-1, 0}: lease lost; {-2, 0}: a trainer holds it.
MARK_DONE_LUA = """
if ARGV[1] == '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return {-2, 0} end
elseif redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {-1, 0}
end
local raw = redis.call('HGET', KEYS[2], ARGV[2])
if not raw then return {0, 1} end
local counter, field, n = ARGV[3], ARGV[4], tonumber(ARGV[5])
local newly = 0
for i = 1, n do
  if redis.call('SETBIT', KEYS[3], tonumber(ARGV[5 + i]), 1) == 0 then
    newly = newly + 1
    if counter == 'dead' then redis.call('XADD', KEYS[5], '*', field, ARGV[5 + n + i]) end
  end
end
if newly == 0 then return {0, 0} end
if counter ~= '' then redis.call('HINCRBY', KEYS[4], counter, newly) end
redis.call('HINCRBY', KEYS[4], 'backlog_done', newly)
local seg = cjson.decode(raw)
seg['remaining'] = seg['remaining'] - newly
if seg['remaining'] <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('DEL', KEYS[3])
  redis.call('HINCRBY', KEYS[4], 'backlog_bytes', -seg['bytes'])
  return {newly, 1}
end
redis.call('HSET', KEYS[2], ARGV[2], cjson.encode(seg))
return {newly, 0}
"""


def mark_done(
    r: redis.Redis,
    job_id: str,
    seg: str,
    positions: list[int],
    counter: str | None,
    *,
    fence: Fence | None,
    dead: list[bytes] | None = None,
) -> tuple[int, bool]:
    """Groups of a segment leave the backlog, each counted once under `counter` (None: no count,
    e.g. an extra copy of a group already counted). `fence`: the trainer's lease (raises
    LeaseLost when it is gone); None: only while no trainer holds the job (returns (0, False)
    if one does). `dead`: with counter 'dead', one encoded DeadLetter per position.
    Returns (groups marked now, whether the segment is finished and its folder may go)."""
    if not positions:
        return 0, False
    if counter == "dead" and (dead is None or len(dead) != len(positions)):
        raise ValueError("counter 'dead' needs one dead-letter payload per position")
    out = r.eval(
        MARK_DONE_LUA,
        5,
        fence.key if fence else keys.trainer_lease(job_id),
        keys.backlog_index(job_id),
        keys.backlog_done(job_id, seg),
        keys.ledger(job_id),
        keys.dead_letter(job_id),
        fence.value if fence else "",
        seg,
        counter or "",
        FIELD,
        len(positions),
        *[int(p) for p in positions],
        *(dead if counter == "dead" else []),
    )
    marked, finished = int(out[0]), bool(int(out[1]))
    if marked == -1:
        raise LeaseLost(f"job {job_id}: lease lost; segment {seg} groups not acknowledged")
    if marked == -2:
        return 0, False
    return marked, finished


def expired(info: SegmentInfo, spec: JobSpec, version: int, now: float) -> bool:
    """Whether even the newest group of a segment is past the job's age limit (a sampled_at of 0
    is unknown: only the versions rule applies then)."""
    b = spec.backlog
    too_old = 0 < info.t_max < now - b.max_age_hours * 3600
    return too_old or version - info.v_max > b.max_age_versions


def expire_segments(
    r: redis.Redis,
    store: ObjectStore,
    rec: JobRecord,
    version: int,
    *,
    fence: Fence | None,
    skip: set[str] | frozenset[str] = frozenset(),
) -> int:
    """Drop every group of the indexed segments past the age limit (ledger dropped_age), and
    delete their folders. The trainer does it under its lease; rollout (fence None) only while
    no trainer holds the job, so expired data never holds the budget while the trainer is away.
    `skip`: segments whose groups the trainer holds in memory. Returns the groups dropped."""
    n, now = 0, time.time()
    for seg, info in read_index(r, rec.id).items():
        if seg in skip or not expired(info, rec.spec, version, now):
            continue
        positions = sorted(set(range(info.groups)) - done_positions(r, rec.id, seg, info.groups))
        marked, finished = mark_done(r, rec.id, seg, positions, "dropped_age", fence=fence)
        n += marked
        if finished:
            try:
                delete_segment(store, rec.id, seg)
            except Exception:  # noqa: BLE001 (clutter, not data: the orphan sweep deletes it later)
                pass
    return n


# -- what the backlog holds, and whether it may grow --------------------------------------
@dataclass
class Totals:
    groups: int = 0  # remaining in indexed segments
    bytes: int = 0  # of indexed segments
    segments: int = 0
    v_min: int | None = None  # oldest policy version in the backlog
    t_min: float | None = None  # oldest sampled_at


def totals(r: redis.Redis, job_id: str) -> Totals:
    t = Totals()
    for info in read_index(r, job_id).values():
        t.groups += info.remaining
        t.bytes += info.bytes
        t.segments += 1
        t.v_min = info.v_min if t.v_min is None else min(t.v_min, info.v_min)
        t.t_min = info.t_min if t.t_min is None else min(t.t_min, info.t_min)
    return t


def hot_limit(spec: JobSpec) -> int:
    """Groups a backlog job may hold in Redis (every stage stream, beyond what the trainer holds).

    The hot window of the ready stream (the in-flight window), one segment accumulating past
    it, one being written, and one segment's worth of prompts in the works upstream. Beyond
    that the groups must reach the disk tier first: if spilling stalls (a store outage), rollout
    idles instead of filling Redis's memory with the backlog."""
    return spec.inflight_window + 3 * spec.backlog.segment_groups


def trainer_held(r: redis.Redis, job_id: str) -> int:
    """Ready entries pending to the trainer (trained or queued, acknowledged at its next checkpoint)."""
    try:
        summary = r.xpending(keys.ready(job_id), keys.GROUP_TRAINER)
    except redis.ResponseError:  # no stream or group yet
        return 0
    return sum(int(c["pending"]) for c in summary.get("consumers") or [] if _s(c["name"]) == "trainer")


def feed_room(r: redis.Redis, rec: JobRecord, led: dict[str, int]) -> tuple[int, str]:
    """How many prompts the feeder may add now, and why none when 0 (the backlog's budget).

    `led`: the job's ledger as read_ledger gives it (counters and in_flight). One rule for the
    feeder and for rollout's /readyz (which says why rollout idles). Without a backlog: the
    in-flight window, as always (docs/architecture.md, invariant 4). O(1) in the backlog's
    size: its groups and bytes are the ledger's running totals."""
    spec = rec.spec
    b = spec.backlog
    in_flight = led["in_flight"]
    window_room = spec.inflight_window - in_flight
    if not b.enabled:
        return max(0, window_room), "" if window_room > 0 else "in-flight window full (no backlog)"
    stored = led.get("backlog_bytes", 0)
    if stored >= b.max_bytes:
        return 0, f"backlog at its byte budget: {stored} of backlog.max_bytes {b.max_bytes} bytes stored"
    room = spec.inflight_window + b.max_groups - in_flight
    if room <= 0:
        return 0, (
            f"backlog at its group budget: {in_flight} groups in flight, in-flight window {spec.inflight_window} "
            f"+ backlog.max_groups {b.max_groups}"
        )
    on_disk = led.get("spilled", 0) - led.get("backlog_done", 0)
    in_redis = in_flight - on_disk - trainer_held(r, rec.id)
    hot_room = hot_limit(spec) - in_redis
    if hot_room <= 0:
        return 0, (
            f"{in_redis} groups wait in Redis for the disk tier (hot limit {hot_limit(spec)}): "
            "spilling is behind or paused (see rollout's spill check)"
        )
    return min(room, hot_room), ""


def held_back(r: redis.Redis, rec: JobRecord, led: dict[str, int], *, trained_unacked: int) -> str:
    """Why the trainer's next batch can never form until it acknowledges the groups it has
    trained ("" when it can), `trained_unacked` being how many it trained since its last
    checkpoint (`led`: read_ledger's view, in_flight included).

    Those groups count as in flight until the checkpoint holding them is stored (invariant 2),
    so they take room in the window (invariant 4). When the feeder has no room (`feed_room`)
    and the groups in flight that are not yet trained are fewer than a batch, nothing more
    comes until the trainer checkpoints and acknowledges: with checkpoint_every above
    max_staleness + 1 a windowed job stalled there for good. The trainer checkpoints at once
    when this says so (services/trainer/loop.py)."""
    untrained = led["in_flight"] - trained_unacked
    if untrained >= rec.spec.batch_size:
        return ""
    room, why = feed_room(r, rec, led)
    if room > 0:
        return ""
    return (
        f"{why}; {trained_unacked} of the {led['in_flight']} groups in flight are trained and wait for a "
        f"checkpoint, and the other {untrained} are fewer than a batch ({rec.spec.batch_size})"
    )


def summary(r: redis.Redis, rec: JobRecord, pointer: int, led: dict[str, int]) -> dict[str, Any] | None:
    """The backlog as the dashboard, /metrics and `burstrl status` show it (None: no backlog)."""
    b = rec.spec.backlog
    if not b.enabled:
        return None
    t = totals(r, rec.id)
    _, full = feed_room(r, rec, led)
    return {
        "groups": t.groups,
        "bytes": t.bytes,
        "segments": t.segments,
        "oldest_versions": None if t.v_min is None else max(0, pointer - t.v_min),
        "oldest_hours": None if t.t_min is None else round(max(0.0, time.time() - t.t_min) / 3600, 3),
        "max_groups": b.max_groups,
        "max_bytes": b.max_bytes,
        "order": b.order,
        "full": full,
    }


def budget_problem(spec: JobSpec, store: ObjectStore) -> str:
    """Why this deployment cannot hold the job's backlog budget ("" when it can).

    A file:// store must have the bytes free on its disk; an S3 store is taken at its word."""
    b = spec.backlog
    if not b.enabled or not isinstance(store, FileStore):
        return ""
    free = shutil.disk_usage(Path(store.root)).free
    if b.max_bytes > free:
        return (
            f"backlog.max_bytes {b.max_bytes} exceeds the {free} bytes free under the object store {store.url}: "
            "lower it, or give the store more room"
        )
    return ""


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
