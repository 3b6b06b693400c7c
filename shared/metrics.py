"""Per-job time series and evaluations, kept durably in Redis.

Each point is a small JSON object in the job's metrics stream (trainer steps, rollout
throughput, ...); evaluations are a hash keyed by policy version so replicas cannot
record one twice. The api serves both; the CLI and dashboard draw them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import redis

from shared import keys
from shared.ledger import consumed
from shared.schema import decode_point, encode_point

log = logging.getLogger(__name__)

MAX_POINTS = 100_000  # per job; approximate trim keeps Redis memory bounded
MAX_SESSION_POINTS = 20_000  # per job: two per trainer session (hourly bursts for over a year)
SESSION = "trainer_session"  # the source of session points


def _append(r: redis.Redis, job_id: str, payload: bytes) -> bytes:
    """Append an encoded point to the job's series; its stream id."""
    return r.xadd(keys.metrics(job_id), {b"m": payload}, maxlen=MAX_POINTS, approximate=True)


def record_point(r: redis.Redis, job_id: str, source: str, values: dict[str, Any]) -> str:
    """Append one point (flat JSON: source, at, then the values) to the job's series; its id."""
    return _append(r, job_id, encode_point(source, time.time(), values)).decode()


def record_session_point(r: redis.Redis, job_id: str, values: dict[str, Any], *, at: float | None = None) -> None:
    """A trainer session's start or end point: in the job's series like every point (the
    dashboard and trackers read it there), then in the session index with its series id
    (`at`: when it happened, if not now).

    Two writes, not one script: a crash between them loses the point from the index only,
    and a session whose start point is missing still shows from its end point. A point the
    index gets twice (its first point, raced by a rebuild) is harmless: readers take each
    session's first start and first end."""
    payload = encode_point(SESSION, time.time() if at is None else at, values)
    mid = _append(r, job_id, payload)
    if not _index_sessions(r, job_id):  # the index was there: add to it (a new one holds the point)
        r.xadd(keys.sessions(job_id), {b"m": payload, b"metrics_id": mid}, maxlen=MAX_SESSION_POINTS, approximate=True)


def _index_sessions(r: redis.Redis, job_id: str, *, attempts: int = 5) -> bool:
    """Make the job's session index from its series if it has none (a job older than the index,
    or whose index was lost), once: the index exists from then on, empty if the series holds
    no session point, so no later call reads the series again. False if it was there already."""
    index = keys.sessions(job_id)
    with r.pipeline(transaction=True) as pipe:
        for _ in range(attempts):
            try:
                pipe.watch(index)
                if pipe.exists(index):
                    return False
                found = [(sid, raw) for sid, raw, p in _series(pipe, job_id) if p.get("source") == SESSION]
                pipe.multi()
                for mid, payload in found:
                    pipe.xadd(index, {b"m": payload, b"metrics_id": mid}, maxlen=MAX_SESSION_POINTS, approximate=True)
                if not found:  # an empty stream: added and trimmed away at once, the key stays
                    pipe.xadd(index, {b"m": b""}, maxlen=0)
                pipe.execute()
                if found:
                    log.info("job %s: session index made from %d points of its series", job_id, len(found))
                return True
            except redis.WatchError:
                continue
    return False


def read_session_points(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    """The job's session points from its index, oldest first, each with `id`: its id in the
    series (the cursor `read_points(after=...)` takes for the steps since). O(sessions): the
    series is read once per job at most, to make a missing index (`_index_sessions`)."""
    _index_sessions(r, job_id)
    out = []
    for sid, fields in r.xrange(keys.sessions(job_id)):
        try:
            p = decode_point(fields[b"m"])
            mid = fields[b"metrics_id"].decode()
        except (KeyError, UnicodeDecodeError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("job %s: session point %s is not valid, skipped: %s", job_id, sid, e)
            continue
        out.append({"id": mid, **p})
    return out


def _series(r: redis.Redis, job_id: str, after: str | None = None) -> Iterator[tuple[bytes, bytes, dict[str, Any]]]:
    """(stream id, payload, point) of the job's series after `after`, oldest first, read a
    thousand at a time; a point that does not decode is skipped, and said so."""
    start = f"({after}" if after else "-"
    while True:
        batch = r.xrange(keys.metrics(job_id), min=start, max="+", count=1000)
        for sid, fields in batch:
            try:
                yield sid, fields[b"m"], decode_point(fields[b"m"])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as e:  # a foreign writer: skip, say so
                log.warning("job %s: metric point %s is not valid metric JSON, skipped: %s", job_id, sid, e)
        if len(batch) < 1000:
            return
        start = f"({batch[-1][0].decode()}"


def read_points(
    r: redis.Redis,
    job_id: str,
    source: str | None = None,
    *,
    after: str | None = None,
    limit: int | None = None,
    with_ids: bool = False,
) -> list[dict[str, Any]]:
    """The job's points, oldest first; with `after` (a stream id) only newer ones. With
    `with_ids` each carries its stream `id`, the cursor for the next call: the dashboard
    and the tracker bridge poll, and a long job holds up to MAX_POINTS."""
    out: list[dict[str, Any]] = []
    for sid, _, p in _series(r, job_id, after):
        if limit is not None and len(out) >= limit:
            break
        if source is None or p.get("source") == source:
            out.append({"id": sid.decode(), **p} if with_ids else p)
    return out


def record_eval(r: redis.Redis, job_id: str, version: int, result: dict[str, Any]) -> None:
    r.hset(keys.evals(job_id), str(version), json.dumps({"version": version, "at": time.time(), **result}))


def read_evals(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    return evals_of(r.hgetall(keys.evals(job_id)))


def evals_of(raw: dict[bytes, bytes]) -> list[dict[str, Any]]:
    """The evaluations in a job's evals hash as read (HGETALL), oldest version first."""
    return sorted((json.loads(v) for v in raw.values()), key=lambda e: e["version"])


def read_ledger(r: redis.Redis, job_id: str) -> dict[str, int]:
    """The job's counters plus in_flight = fed - consumed (see shared/ledger.py)."""
    return ledger_of(r.hgetall(keys.ledger(job_id)))


def ledger_of(raw: dict[bytes, bytes]) -> dict[str, int]:
    """A job's ledger hash as read (HGETALL), with in_flight."""
    led = {k.decode(): int(v) for k, v in raw.items()}
    led["in_flight"] = led.get("fed", 0) - consumed(led)
    return led
