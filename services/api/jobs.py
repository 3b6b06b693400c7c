"""Job domain functions: plain, keyword-only, over Redis. The router is a thin layer.

Errors are domain exceptions (JobNotFound, BadTransition, UnreadableJob, SpecProblem),
mapped to HTTP codes by the router.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import redis

from services.api import recovery
from services.api.checks import check_spec, job_warnings
from services.api.overview import trainer_waits
from shared import keys
from shared.bus import Bus
from shared.job import JobRecord, JobSpec, JobState, UnreadableJob, insert_job, load_job, parse_job, update_job
from shared.ledger import init_ledger
from shared.metrics import read_evals, read_ledger, read_points
from shared.policy import init_pointer, read_pointer
from shared.store import ObjectStore


class JobNotFound(KeyError):
    pass


class BadTransition(ValueError):
    pass


def create_job(r: redis.Redis, *, spec: JobSpec) -> JobRecord:
    """Check `spec` against what is registered and served (SpecProblem if it could never run), then store it."""
    check_spec(r, spec)
    now = time.time()
    rec = JobRecord(
        id=f"{spec.name}-{secrets.token_hex(3)}", spec=spec, state=JobState.running, created_at=now, updated_at=now
    )
    Bus.ensure_groups(r, rec.id)
    pipe = r.pipeline(transaction=True)
    insert_job(pipe, rec)
    init_pointer(pipe, rec.id)  # version 0 = the base model, no adapter
    init_ledger(pipe, rec.id)
    pipe.sadd(keys.active_jobs(), rec.id)
    pipe.execute()
    return rec


def get_job(r: redis.Redis, *, job_id: str) -> JobRecord:
    rec = load_job(r, job_id)
    if rec is None:
        raise JobNotFound(job_id)
    return rec


def read_jobs(r: redis.Redis) -> tuple[list[JobRecord], dict[str, str]]:
    """(every readable job, oldest first; job id -> why its record cannot be read).

    An unreadable record (written by another version, or damaged) is left out of the
    first and reported in the second, so one bad record never breaks the others."""
    recs, unreadable = [], {}
    for raw_id, raw in r.hgetall(keys.jobs_index()).items():
        job_id = raw_id.decode(errors="replace")
        try:
            recs.append(parse_job(job_id, raw))
        except UnreadableJob as e:
            unreadable[job_id] = str(e)
    return sorted(recs, key=lambda j: j.created_at), unreadable


def list_jobs(r: redis.Redis) -> list[JobRecord]:
    return read_jobs(r)[0]


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

    rec = update_job(r, job_id, change)  # UnreadableJob: the router says so
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
        "warnings": job_warnings(r, rec.spec, job_id) + trainer_waits(r, job_id)
        if rec.state == JobState.running
        else [],
    }


# A job in these states may still be acted on by a stage: deleting it under them would
# look to them like lost state (docs/architecture.md, invariant 11). Cancel it first.
LIVE_STATES = {JobState.pending, JobState.running, JobState.paused}


def store_prefix(job_id: str) -> str:
    """Where a job's artifacts live in the object store (record copy, policy versions, checkpoints, fences)."""
    return f"jobs/{job_id}/"


def delete_job(
    r: redis.Redis, *, job_id: str, store: ObjectStore | None = None, purge_store: bool = False
) -> dict[str, Any]:
    """Remove every Redis key of a job that is not live: its record, active-set entry and
    every per-job key (streams, ledger, pointer, evals, metrics, claims, lease, epoch,
    failures: all under keys.job_key_pattern). An unreadable record can always be deleted
    (that is how it is mended).

    The store's artifacts stay, marked deleted on purpose (recovery.mark_deleted) so they
    are never taken for a job Redis lost; with `purge_store` they go too. The mark is
    written before the Redis keys go and removed last, so a crash half way never leaves
    the job looking orphaned (and recoverable).

    Raises JobNotFound, or BadTransition for a live job or one a trainer still holds.
    """
    if ":" in job_id:  # no job id has one; the key pattern must never reach another job's keys
        raise JobNotFound(job_id)
    index = keys.jobs_index()
    marked = False
    try:
        for _ in range(50):
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(index, keys.trainer_lease(job_id))
                    raw = pipe.hget(index, job_id)
                    if raw is None:
                        raise JobNotFound(job_id)
                    try:
                        state: JobState | None = parse_job(job_id, raw).state
                    except UnreadableJob:
                        state = None  # no stage serves an unreadable record
                    if state in LIVE_STATES:
                        raise BadTransition(f"cannot delete a job that is {state.value}: cancel it first")
                    if pipe.exists(keys.trainer_lease(job_id)):
                        raise BadTransition(
                            "a trainer still holds this job's lease (it stops at its next step); try again shortly"
                        )
                    if store is not None and not marked:
                        recovery.mark_deleted(store, job_id)
                        marked = True
                    found = list(pipe.scan_iter(match=keys.job_key_pattern(job_id), count=500))
                    pipe.multi()
                    pipe.hdel(index, job_id)
                    pipe.srem(keys.active_jobs(), job_id)
                    for key in found:
                        pipe.delete(key)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        else:
            raise RuntimeError(f"job {job_id}: the job table kept changing while deleting it")
    except BaseException:
        if marked and store is not None and r.hexists(index, job_id):  # not deleted after all
            store.delete(f"{store_prefix(job_id)}{recovery.DELETED_FILE}")
        raise
    purged = 0
    if store is not None and purge_store:
        mark = f"{store_prefix(job_id)}{recovery.DELETED_FILE}"
        for key in store.list(store_prefix(job_id)):
            if key != mark:
                store.delete(key)
                purged += 1
        store.delete(mark)  # last: until here the folder is known to be deleted on purpose
    return {"id": job_id, "deleted_keys": len(found), "purged_objects": purged, "store_kept": not purge_store}
