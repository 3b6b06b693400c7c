"""Per-job time series and evaluations, kept durably in Redis.

Each point is a small JSON object in the job's metrics stream (trainer steps, rollout
throughput, ...); evaluations are a hash keyed by policy version so replicas cannot
record one twice. The api serves both; the CLI and dashboard draw them.
"""

from __future__ import annotations

import json
import logging
import time
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


def record_session_point(r: redis.Redis, job_id: str, values: dict[str, Any]) -> None:
    """A trainer session's start or end point: in the job's series like every point (the
    dashboard and trackers read it there), then in the session index with its series id.

    Two writes, not one script: a crash between them loses the point from the index only,
    and a session whose start point is missing still shows from its end point."""
    payload = encode_point(SESSION, time.time(), values)
    mid = _append(r, job_id, payload)
    r.xadd(keys.sessions(job_id), {b"m": payload, b"metrics_id": mid}, maxlen=MAX_SESSION_POINTS, approximate=True)


def read_session_points(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    """The job's session points, oldest first, each with `id`: its id in the series (the
    cursor `read_points(after=...)` takes for the steps since). A job whose trainer predates
    the index has its session points only in the series: read them there."""
    entries = r.xrange(keys.sessions(job_id))
    if not entries:
        return read_points(r, job_id, SESSION, with_ids=True)
    out = []
    for sid, fields in entries:
        try:
            p = decode_point(fields[b"m"])
            mid = fields[b"metrics_id"].decode()
        except (KeyError, UnicodeDecodeError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("job %s: session point %s is not valid, skipped: %s", job_id, sid, e)
            continue
        out.append({"id": mid, **p})
    return out


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
    start = f"({after}" if after else "-"
    while limit is None or len(out) < limit:
        batch = r.xrange(keys.metrics(job_id), min=start, max="+", count=1000)
        for sid, fields in batch:
            try:
                p = decode_point(fields[b"m"])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:  # a foreign writer: skip, say so
                log.warning("job %s: metric point %s is not valid metric JSON, skipped: %s", job_id, sid, e)
                continue
            if source is None or p.get("source") == source:
                out.append({"id": sid.decode(), **p} if with_ids else p)
        if len(batch) < 1000:
            break
        start = f"({batch[-1][0].decode()}"
    return out if limit is None else out[:limit]


def record_eval(r: redis.Redis, job_id: str, version: int, result: dict[str, Any]) -> None:
    r.hset(keys.evals(job_id), str(version), json.dumps({"version": version, "at": time.time(), **result}))


def read_evals(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    evals = [json.loads(v) for v in r.hgetall(keys.evals(job_id)).values()]
    return sorted(evals, key=lambda e: e["version"])


def read_ledger(r: redis.Redis, job_id: str) -> dict[str, int]:
    """The job's counters plus in_flight = fed - consumed (see shared/ledger.py)."""
    led = {k.decode(): int(v) for k, v in r.hgetall(keys.ledger(job_id)).items()}
    led["in_flight"] = led.get("fed", 0) - consumed(led)
    return led
