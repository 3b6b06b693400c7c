"""Per-job time series and evaluations, kept durably in Redis.

Each point is a small JSON object in the job's metrics stream (trainer steps, rollout
throughput, ...); evaluations are a hash keyed by policy version so replicas cannot
record one twice. The api serves both; the CLI and dashboard draw them.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from shared import keys

MAX_POINTS = 100_000  # per job; approximate trim keeps Redis memory bounded


def record_point(r: redis.Redis, job_id: str, source: str, values: dict[str, Any]) -> None:
    point = {"source": source, "at": time.time(), **values}
    r.xadd(keys.metrics(job_id), {b"m": json.dumps(point)}, maxlen=MAX_POINTS, approximate=True)


def read_points(r: redis.Redis, job_id: str, source: str | None = None) -> list[dict[str, Any]]:
    out = []
    for _, fields in r.xrange(keys.metrics(job_id)):
        p = json.loads(fields[b"m"])
        if source is None or p.get("source") == source:
            out.append(p)
    return out


def record_eval(r: redis.Redis, job_id: str, version: int, result: dict[str, Any]) -> None:
    r.hset(keys.evals(job_id), str(version), json.dumps({"version": version, "at": time.time(), **result}))


def read_evals(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    evals = [json.loads(v) for v in r.hgetall(keys.evals(job_id)).values()]
    return sorted(evals, key=lambda e: e["version"])


def read_ledger(r: redis.Redis, job_id: str) -> dict[str, int]:
    led = {k.decode(): int(v) for k, v in r.hgetall(keys.ledger(job_id)).items()}
    consumed = led.get("trained", 0) + led.get("dead", 0) + sum(v for k, v in led.items() if k.startswith("dropped_"))
    led["in_flight"] = led.get("fed", 0) - consumed
    return led
