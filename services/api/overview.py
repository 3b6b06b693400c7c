"""Read-only views over Redis for the dashboard and `GET /v1/services`.

Everything here is derived on request from what the stages already keep durably
(heartbeats, stream lengths, consumer-group info, ledger, policy pointer), so the api
holds no state of its own and a restarted api shows the same picture.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis

from shared import keys
from shared.backlog import summary as backlog_summary
from shared.job import JobRecord
from shared.metrics import read_evals, read_ledger
from shared.policy import read_pointer
from shared.schema import decode_heartbeat

# Stage streams in pipeline order, with the consumer group that reads each.
STAGES = ("prompts", "rollouts", "scored", "ready")


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def list_services(r: redis.Redis) -> list[dict[str, Any]]:
    """Every live heartbeat (a replica that stopped beating has expired out of Redis)."""
    out = []
    now = time.time()
    for key in r.scan_iter(match=keys.service_pattern(), count=200):
        raw = r.get(key)
        if not raw:
            continue  # expired between SCAN and GET
        try:
            beat = msgspec.structs.asdict(decode_heartbeat(raw))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # a foreign or corrupt key must not take the registry down (500)
        beat["age_s"] = round(now - beat["at"], 1)
        out.append(beat)
    return sorted(out, key=lambda b: (str(b["role"]), str(b["replica"])))


def trainer_waits(r: redis.Redis, job_id: str) -> list[str]:
    """What trainers holding `job_id` say holds its next batch up: their `progress` check, degraded
    once no batch has formed for a while (services/trainer/progress.py; its reason starts with
    "job {id}:")."""
    return [
        f"trainer {b['replica']}: {why}"
        for b in list_services(r)
        if b["role"] == "trainer" and (why := b.get("reasons", {}).get("progress", "")).startswith(f"job {job_id}:")
    ]


def stream_info(r: redis.Redis, stream: str, group: str) -> dict[str, Any]:
    """Length of a stage stream and how far its consumer group is behind."""
    info: dict[str, Any] = {"length": int(r.xlen(stream)), "pending": 0, "lag": None}
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream yet
        return info
    for g in groups:
        if _s(g.get("name", b"")) == group:
            info["pending"] = int(g.get("pending", 0) or 0)
            lag = g.get("lag")
            info["lag"] = int(lag) if lag is not None else None  # Redis < 7 has no lag
    return info


def job_overview(r: redis.Redis, rec: JobRecord, services: list[dict[str, Any]]) -> dict[str, Any]:
    """One job's queues, ledger, policy pointer and which version each replica serves."""
    streams = keys.job_streams(rec.id)
    queues = {name: stream_info(r, stream, streams[stream]) for name, stream in zip(STAGES, streams, strict=True)}
    queues["dead"] = {"length": int(r.xlen(keys.dead_letter(rec.id))), "pending": 0, "lag": None}
    pointer = read_pointer(r, rec.id)
    # Adoption: rollout and trainer replicas report {job: version} in their heartbeat.
    adoption = []
    for svc in services:
        versions = svc.get("policy_versions")
        if isinstance(versions, dict) and isinstance(versions.get(rec.id), int):
            v = versions[rec.id]
            adoption.append({"role": svc["role"], "replica": svc["replica"], "version": v, "behind": pointer - v})
    evals = read_evals(r, rec.id)
    ledger = read_ledger(r, rec.id)
    return {
        "id": rec.id,
        "state": rec.state.value,
        "task": rec.spec.task,
        "steps": rec.spec.steps,
        "created_at": rec.created_at,
        "policy_version": pointer,
        "ledger": ledger,
        "queues": queues,
        "adoption": adoption,
        "last_eval": evals[-1] if evals else None,
        # The disk tier: groups, bytes, the age of the oldest, and the budget that is full (None: windowed job).
        "backlog": backlog_summary(r, rec, pointer, ledger),
    }


def overview(r: redis.Redis, jobs: list[JobRecord]) -> dict[str, Any]:
    services = list_services(r)
    return {
        "at": time.time(),
        "services": services,
        "jobs": [job_overview(r, rec, services) for rec in jobs],
    }
