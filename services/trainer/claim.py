"""Which job a trainer takes: the first running one (or the configured one) whose lease it
can take. Taking the lease bumps the job's fencing epoch; before anything else the new
holder records the takeover in the store (shared/fence.py), so whatever a deposed holder
writes from then on is refused by every reader."""

from __future__ import annotations

import logging

from services.trainer.checkpoint import latest_checkpoint
from services.trainer.settings import TrainerSettings
from shared.fence import max_epoch, record_takeover
from shared.job import JobRecord, JobState, UnreadableJob, load_job
from shared.lease import Lease
from shared.policy import latest_version
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore

log = logging.getLogger(__name__)


def claim_job(rt: ServiceRuntime, settings: TrainerSettings, store: ObjectStore) -> tuple[JobRecord, Lease] | None:
    """The first running job (or the configured one) whose lease we can take, with that lease.

    Taking the lease bumps the job's fencing epoch; before anything else the new holder
    records the takeover in the store (shared/fence.py), so whatever a deposed holder writes
    from now on is refused by every reader."""
    candidates = [settings.job] if settings.job else active_job_ids(rt.redis)
    for job_id in candidates:
        try:
            rec = load_job(rt.redis, job_id)
        except UnreadableJob as e:
            log.error("%s; skipped", e)
            continue
        if rec is None or rec.state != JobState.running or rec.spec.tinker:  # Tinker models: services/trainer/tinker
            continue
        lease = take_lease(rt, settings, store, job_id)
        if lease is not None:
            return rec, lease
    return None


def take_lease(rt: ServiceRuntime, settings: TrainerSettings, store: ObjectStore, job_id: str) -> Lease | None:
    """The job's lease if it is free (None if another trainer holds it), its takeover recorded
    in the store before anything else is written: from now on a deposed holder's writes are
    refused by every reader."""
    lease = Lease(rt.redis, job_id, settings.replica, settings.lease_s)
    if not lease.acquire(floor=max_epoch(store, job_id)):  # never an epoch the store has seen
        return None
    try:
        version = latest_version(store, job_id)
        ckpt = latest_checkpoint(store, job_id)
        record_takeover(
            store, job_id, lease.epoch, lease.token, version=version, checkpoint=-1 if ckpt is None else ckpt
        )
    except BaseException:
        lease.release()
        raise
    log.info("job %s: lease taken (epoch %d; store has v%d, checkpoint %s)", job_id, lease.epoch, version, ckpt)
    return lease
