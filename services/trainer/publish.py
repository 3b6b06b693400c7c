"""Publishing a step's policy version, and claiming a job: the trainer's fenced writes to the store.

A version is an immutable folder, manifest last (docs/architecture.md, invariant 5), written
under the trainer's lease epoch (invariant 10). A version already in the store at the
trainer's step (it resumed from an older checkpoint) is kept only if it verifies, no deposed
trainer wrote it and its probe agrees with these weights; else it is replaced, manifest first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.trainer.checkpoint import latest_checkpoint
from services.trainer.settings import TrainerSettings
from shared.fence import max_epoch, record_takeover, refusal
from shared.job import JobRecord, JobState, UnreadableJob, load_job
from shared.lease import Lease
from shared.policy import (
    MANIFEST,
    Manifest,
    ProbeMismatch,
    check_probe,
    latest_version,
    publish_version,
    read_manifest,
    version_prefix,
)
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore, StoreError, VerificationError, get_folder

log = logging.getLogger("services.trainer.loop")


def publish_step(
    store: ObjectStore,
    rec: JobRecord,
    v: int,
    files: dict[str, bytes],
    probe: dict[str, list],
    *,
    epoch: int,
    tolerance: float,
    assert_lease: Callable[[], None],
) -> float | None:
    """Publish version v (files, then the manifest). Returns its manifest's created_at, or None
    when the version already stored is kept."""
    prefix = version_prefix(rec.id, v)
    if store.exists(f"{prefix}/{MANIFEST}"):
        why = existing_version_problem(store, rec.id, v, probe, tolerance)
        if not why:
            # Re-trained after resuming from an older checkpoint: versions are immutable, and
            # this one is ours in all but name (its probe agrees with these weights).
            log.info("job %s: policy v%d already published and matches these weights; keeping it", rec.id, v)
            return None
        # Rollout would refuse it (or serve weights that are not ours). Replace it, manifest
        # first, so no reader ever sees the new files under the old manifest.
        log.error("job %s: policy v%d in the store %s; publishing it again", rec.id, v, why)
        assert_lease()
        store.delete(f"{prefix}/{MANIFEST}")
    m = Manifest(job_id=rec.id, version=v, step=v, base_model=rec.spec.base_model, files={}, probe=probe, epoch=epoch)
    publish_version(store, m, files, before_manifest=assert_lease)
    return m.created_at


def existing_version_problem(store: ObjectStore, job_id: str, v: int, probe: dict[str, list], tolerance: float) -> str:
    """Why the stored version v must be replaced ("" when it may stay): torn or tampered
    files, a deposed trainer's write, or weights other than these (a forged version)."""
    try:
        meta, _ = get_folder(store, version_prefix(job_id, v))  # every hash checked
        m = Manifest(**meta)
    except (VerificationError, StoreError, ValueError, KeyError, TypeError) as e:
        return f"is corrupt ({type(e).__name__}: {e})"
    if why := refusal(store, job_id, "version", v, m.epoch):
        return f"was written by a deposed trainer ({why})"
    try:
        check_probe(m.probe, probe["logprobs"], tolerance)
    except ProbeMismatch as e:
        return f"does not hold these weights ({e})"
    return ""


def published_at(store: ObjectStore, job_id: str, version: int) -> float | None:
    """When version's manifest was written (None: not published, or unreadable)."""
    if version <= 0:
        return None
    try:
        return read_manifest(store, job_id, version).created_at
    except (StoreError, ValueError, TypeError):
        return None


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
        if rec is None or rec.state != JobState.running:
            continue
        lease = Lease(rt.redis, job_id, settings.replica, settings.lease_s)
        if not lease.acquire(floor=max_epoch(store, job_id)):  # never an epoch the store has seen
            continue
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
        return rec, lease
    return None
