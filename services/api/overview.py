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
from shared.metrics import evals_of, ledger_of
from shared.policy import pointer_of
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


def _group_info(groups: Any, group: str) -> tuple[int, int | None]:
    """(pending, lag) of `group` in an XINFO GROUPS answer (an error: no such stream yet)."""
    if isinstance(groups, Exception):
        return 0, None
    for g in groups:
        if _s(g.get("name", b"")) == group:
            lag = g.get("lag")
            return int(g.get("pending", 0) or 0), int(lag) if lag is not None else None  # Redis < 7 has no lag
    return 0, None


def _job_reads(r: redis.Redis, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per job, what its line on the dashboard reads: each stage stream's length and how far its
    consumer group is behind, the dead-letter stream's length, the policy pointer, the ledger and
    the evaluations; one round trip for every job (a pipeline), not a dozen per job."""
    pipe = r.pipeline(transaction=False)
    for job_id in job_ids:
        for stream in keys.job_streams(job_id):
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        pipe.xlen(keys.dead_letter(job_id))
        pipe.get(keys.policy_pointer(job_id))
        pipe.hgetall(keys.ledger(job_id))
        pipe.hgetall(keys.evals(job_id))
    answers = iter(pipe.execute(raise_on_error=False))
    out = {}
    for job_id in job_ids:
        queues = {}
        for name, group in zip(STAGES, keys.job_streams(job_id).values(), strict=True):
            length, groups = next(answers), next(answers)
            pending, lag = _group_info(groups, group)
            queues[name] = {"length": int(length), "pending": pending, "lag": lag}
        queues["dead"] = {"length": int(next(answers)), "pending": 0, "lag": None}
        pointer, ledger, evals = pointer_of(next(answers)), ledger_of(next(answers)), evals_of(next(answers))
        out[job_id] = {"queues": queues, "pointer": pointer, "ledger": ledger, "evals": evals}
    return out


def job_overview(
    r: redis.Redis, rec: JobRecord, services: list[dict[str, Any]], read: dict[str, Any]
) -> dict[str, Any]:
    """One job's queues, ledger, policy pointer and which version each replica serves."""
    pointer, ledger, evals = read["pointer"], read["ledger"], read["evals"]
    # Adoption: rollout and trainer replicas report {job: version} in their heartbeat.
    adoption = []
    for svc in services:
        versions = svc.get("policy_versions")
        if isinstance(versions, dict) and isinstance(versions.get(rec.id), int):
            v = versions[rec.id]
            adoption.append({"role": svc["role"], "replica": svc["replica"], "version": v, "behind": pointer - v})
    return {
        "id": rec.id,
        "state": rec.state.value,
        "task": rec.spec.task,
        "steps": rec.spec.steps,
        "created_at": rec.created_at,
        "policy_version": pointer,
        "ledger": ledger,
        "queues": read["queues"],
        "adoption": adoption,
        "last_eval": evals[-1] if evals else None,
        # The disk tier: groups, bytes, the age of the oldest, and the budget that is full (None: windowed job).
        "backlog": backlog_summary(r, rec, pointer, ledger),
    }


def overview(r: redis.Redis, jobs: list[JobRecord]) -> dict[str, Any]:
    services = list_services(r)
    reads = _job_reads(r, [rec.id for rec in jobs])
    return {
        "at": time.time(),
        "services": services,
        "jobs": [job_overview(r, rec, services, reads[rec.id]) for rec in jobs],
    }
