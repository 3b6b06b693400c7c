"""Job domain functions: plain, keyword-only, over Redis. The router is a thin layer."""

from __future__ import annotations

import secrets
import time
from typing import Any

import redis

from shared import keys
from shared.bus import Bus
from shared.job import JobRecord, JobSpec, JobState, UnreadableJob, insert_job, load_job, parse_job, update_job
from shared.metrics import read_evals, read_ledger, read_points
from shared.policy import init_pointer, read_pointer


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
    insert_job(pipe, rec)
    init_pointer(pipe, rec.id)  # version 0 = the base model, no adapter
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
    """Every readable job, oldest first. An unreadable record is left out (and counted by
    `unreadable_jobs`), so one bad record never breaks the listing of the others."""
    recs = []
    for job_id, raw in r.hgetall(keys.jobs_index()).items():
        try:
            recs.append(parse_job(job_id.decode(), raw))
        except UnreadableJob:
            continue
    return sorted(recs, key=lambda j: j.created_at)


def unreadable_jobs(r: redis.Redis) -> dict[str, str]:
    """job id -> why its stored record cannot be read."""
    out = {}
    for job_id, raw in r.hgetall(keys.jobs_index()).items():
        try:
            parse_job(job_id.decode(), raw)
        except UnreadableJob as e:
            out[job_id.decode()] = str(e)
    return out


_TRANSITIONS = {
    "cancel": ({JobState.pending, JobState.running, JobState.paused}, JobState.cancelled),
    "pause": ({JobState.running}, JobState.paused),
    "resume": ({JobState.paused}, JobState.running),
}


def transition(r: redis.Redis, *, job_id: str, action: str) -> JobRecord:
    allowed, target = _TRANSITIONS[action]
    refused: list[JobState] = []

    def change(rec: JobRecord) -> bool:
        if rec.state not in allowed:
            refused.append(rec.state)
            return False
        rec.state = target
        return True

    rec = update_job(r, job_id, change)
    if rec is None:
        raise JobNotFound(job_id)
    if refused:
        raise BadTransition(f"cannot {action} a job that is {refused[-1].value}")
    if target == JobState.cancelled:
        r.srem(keys.active_jobs(), job_id)
    return rec


def job_status(r: redis.Redis, *, job_id: str) -> dict[str, Any]:
    rec = get_job(r, job_id=job_id)
    version = read_pointer(r, job_id)
    trainer = read_points(r, job_id, "trainer")
    return {
        "job": rec.model_dump(mode="json"),
        "policy_version": version,
        "ledger": read_ledger(r, job_id),
        "evals": read_evals(r, job_id),
        "last_step": trainer[-1] if trainer else None,
    }
