"""Job domain functions: plain, keyword-only, over Redis. The router is a thin layer.

Errors are domain exceptions (JobNotFound, BadTransition, UnreadableJob, SpecProblem),
mapped to HTTP codes by the router.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from services.api import pages, recovery
from services.api.checks import check_spec, job_warnings
from services.api.overview import trainer_waits
from shared import keys
from shared.bus import Bus
from shared.job import (
    JobRecord,
    JobSpec,
    JobState,
    JobTaken,
    UnreadableJob,
    ensure_indexes,
    insert_job,
    load_job,
    page_of_jobs,
    parse_job,
    remove_job,
    update_job,
)
from shared.ledger import init_ledger
from shared.metrics import read_evals, read_ledger, read_points
from shared.policy import init_pointer, read_pointer
from shared.store import ObjectStore

log = logging.getLogger(__name__)


class JobNotFound(KeyError):
    pass


class BadTransition(ValueError):
    pass


ID_ATTEMPTS = 20  # fresh suffixes tried before giving up (each is taken with odds n / 2**24)


def _suffix() -> str:
    return secrets.token_hex(3)


def create_job(
    r: redis.Redis, *, spec: JobSpec, store: ObjectStore | None = None, suffix: Callable[[], str] = _suffix
) -> JobRecord:
    """Check `spec` against what is registered and served (SpecProblem if it could never run), then
    store it under a new id, `{name}-{suffix()}`, never over another job: an id Redis holds (a live
    job) or the store holds (a job Redis lost, or one deleted with its artifacts kept) is passed
    over for a fresh suffix. `suffix` is the random source (tests force collisions with it)."""
    check_spec(r, spec)
    for _ in range(ID_ATTEMPTS):
        job_id = f"{spec.name}-{suffix()}"
        if store is not None and store.list(store_prefix(job_id)):
            continue
        now = time.time()
        rec = JobRecord(id=job_id, spec=spec, state=JobState.running, created_at=now, updated_at=now)
        Bus.ensure_groups(r, rec.id)  # a no-op on a taken id's streams

        def keys_beside(pipe: Pipeline, job_id: str = job_id) -> None:
            init_pointer(pipe, job_id)  # version 0 = the base model, no adapter
            init_ledger(pipe, job_id)

        try:
            insert_job(r, rec, also=keys_beside, active=True)
        except JobTaken:
            log.warning("job id %s is taken; drawing another", job_id)
            continue
        return rec
    raise JobTaken(f"{ID_ATTEMPTS} ids for name {spec.name!r} were all taken")


def get_job(r: redis.Redis, *, job_id: str) -> JobRecord:
    rec = load_job(r, job_id)
    if rec is None:
        raise JobNotFound(job_id)
    return rec


def _parsed(found: Iterable[tuple[str, bytes | None]]) -> tuple[list[JobRecord], dict[str, str]]:
    """(the readable jobs of (id, stored record) pairs, in their order; job id -> why its record
    cannot be read). An unreadable record (written by another version, or damaged) is left out
    of the first and reported in the second, so one bad record never breaks the others; a
    record that went meanwhile (None) is left out."""
    recs, unreadable = [], {}
    for job_id, raw in found:
        if raw is None:
            continue
        try:
            recs.append(parse_job(job_id, raw))
        except UnreadableJob as e:
            unreadable[job_id] = str(e)
    return recs, unreadable


@dataclass
class JobPage:
    jobs: list[JobRecord]  # newest first
    unreadable: dict[str, str]  # job id -> why, for the records of this page that cannot be read
    cursor: str | None  # where the next page starts; None: this is the last


def list_page(r: redis.Redis, *, state: JobState | None, limit: int, cursor: str | None) -> JobPage:
    """One page of the job table, newest first, of every state or of `state`: O(limit), whatever
    the number of jobs. BadCursor for a cursor this api did not issue for this query."""
    want = state.value if state is not None else ""
    after = pages.read(r, cursor, state=want) if cursor else None
    ensure_indexes(r)  # O(1) unless a record was written around them
    found, last = page_of_jobs(r, state=state, after=after, limit=limit)
    recs, unreadable = _parsed(found)
    return JobPage(recs, unreadable, pages.issue(r, member=last, state=want) if last else None)


DASHBOARD_RECENT = 20  # jobs the dashboard shows beside the active ones: the newest, of any state


def dashboard_jobs(r: redis.Redis) -> tuple[list[JobRecord], dict[str, str]]:
    """What the dashboard shows: the active jobs (those the stages serve) and the newest
    DASHBOARD_RECENT of any state, newest first; O(active jobs), whatever the table holds."""
    ensure_indexes(r)
    newest, _ = page_of_jobs(r, state=None, after=None, limit=DASHBOARD_RECENT)
    shown = {job_id for job_id, _ in newest}
    active = sorted(m.decode() for m in r.smembers(keys.active_jobs()) if m.decode() not in shown)
    raws = r.hmget(keys.jobs_index(), active) if active else []
    recs, unreadable = _parsed([*newest, *zip(active, raws, strict=True)])
    return sorted(recs, key=lambda j: -j.created_at), unreadable


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
            # The job table's keys are on one Redis Cluster slot, the job's on another (shared/keys.py):
            # the record goes in a MULTI on the table's slot, then the job's keys, on theirs.
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(index)
                    raw = pipe.hget(index, job_id)
                    if raw is None:
                        raise JobNotFound(job_id)
                    try:
                        state: JobState | None = parse_job(job_id, raw).state
                    except UnreadableJob:
                        state = None  # no stage serves an unreadable record
                    if state in LIVE_STATES:
                        raise BadTransition(f"cannot delete a job that is {state.value}: cancel it first")
                    # Read beside the WATCH (another slot): a trainer takes no lease on a job that is not
                    # live, and one that held it on until now finds no record at its next step.
                    if r.exists(keys.trainer_lease(job_id)):
                        raise BadTransition(
                            "a trainer still holds this job's lease (it stops at its next step); try again shortly"
                        )
                    if store is not None and not marked:
                        recovery.mark_deleted(store, job_id)
                        marked = True
                    pipe.multi()
                    remove_job(pipe, job_id, raw)
                    pipe.srem(keys.active_jobs(), job_id)
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
    # The record is gone, so no stage serves the job again: its keys go now. A crash in between leaves
    # keys no record names (the id stays taken: its creation mark is one of them).
    found = list(r.scan_iter(match=keys.job_key_pattern(job_id), count=500))
    if found:  # one command: a job's keys share one hash tag, so one Cluster slot
        r.delete(*found)
    purged = 0
    if store is not None and purge_store:
        mark = f"{store_prefix(job_id)}{recovery.DELETED_FILE}"
        for key in store.list(store_prefix(job_id)):
            if key != mark:
                store.delete(key)
                purged += 1
        store.delete(mark)  # last: until here the folder is known to be deleted on purpose
    return {"id": job_id, "deleted_keys": len(found), "purged_objects": purged, "store_kept": not purge_store}
