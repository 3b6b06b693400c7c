"""Job domain functions: plain, keyword-only, over Redis. The router is a thin layer."""

from __future__ import annotations

import secrets
import time
from typing import Any

import redis

from shared import keys
from shared.bus import Bus
from shared.job import JobRecord, JobSpec, JobState, load_job, save_job
from shared.metrics import read_evals, read_ledger, read_points


class JobNotFound(KeyError):
    pass


class BadTransition(ValueError):
    pass


def create_job(r: redis.Redis, *, spec: JobSpec) -> JobRecord:
    now = time.time()
    rec = JobRecord(
        id=f"{spec.name}-{secrets.token_hex(3)}", spec=spec, state=JobState.running, created_at=now, updated_at=now
    )
    Bus.ensure_groups(r, rec.id)
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.jobs_index(), rec.id, rec.model_dump_json())
    pipe.set(keys.policy_pointer(rec.id), 0)  # version 0 = the base model, no adapter
    pipe.hset(keys.ledger(rec.id), mapping={"fed": 0, "produced": 0, "scored": 0, "trained": 0, "dead": 0})
    pipe.sadd(keys.active_jobs(), rec.id)
    pipe.execute()
    return rec


def get_job(r: redis.Redis, *, job_id: str) -> JobRecord:
    rec = load_job(r, job_id)
    if rec is None:
        raise JobNotFound(job_id)
    return rec


def list_jobs(r: redis.Redis) -> list[JobRecord]:
    recs = [JobRecord.model_validate_json(v) for v in r.hgetall(keys.jobs_index()).values()]
    return sorted(recs, key=lambda j: j.created_at)


_TRANSITIONS = {
    "cancel": ({JobState.pending, JobState.running, JobState.paused}, JobState.cancelled),
    "pause": ({JobState.running}, JobState.paused),
    "resume": ({JobState.paused}, JobState.running),
}


def transition(r: redis.Redis, *, job_id: str, action: str) -> JobRecord:
    allowed, target = _TRANSITIONS[action]
    rec = get_job(r, job_id=job_id)
    if rec.state not in allowed:
        raise BadTransition(f"cannot {action} a job that is {rec.state.value}")
    rec.state = target
    rec.updated_at = time.time()
    save_job(r, rec)
    if target == JobState.cancelled:
        r.srem(keys.active_jobs(), job_id)
    return rec


def job_status(r: redis.Redis, *, job_id: str) -> dict[str, Any]:
    rec = get_job(r, job_id=job_id)
    version = int(r.get(keys.policy_pointer(job_id)) or 0)
    trainer = read_points(r, job_id, "trainer")
    return {
        "job": rec.model_dump(mode="json"),
        "policy_version": version,
        "ledger": read_ledger(r, job_id),
        "evals": read_evals(r, job_id),
        "last_step": trainer[-1] if trainer else None,
    }
