"""Jobs the object store holds but Redis does not: list them, and register them again.

docs/architecture.md, invariant 11: the store survives what Redis loses. At creation the api
writes the job's record to `jobs/{job}/job.json`; the trainer's checkpoints and versions
live beside it. A job folder whose id Redis does not know, and that was not deleted on
purpose (`jobs/{job}/deleted.json`), is orphaned: Redis lost it. The api lists orphans in
`GET /v1/jobs/orphaned` (and `burstrl jobs`), is not ready while any exist, and
`POST /v1/jobs/recover` registers them again from the store:

- the record as submitted, running unless its newest checkpoint already holds every step;
- its policy pointer at the newest checkpoint's step (what the trainer resumes from), and
  the trainer's fencing epoch counter above every epoch the store recorded;
- its ledger as trained = fed = the groups its newest checkpoint holds, nothing in flight:
  groups that were in flight when Redis lost them were never trained, and the feeder
  simply feeds on from there (some prompts of the lost window are sampled again);
- then a new dataset id that supersedes the ids the running services remember, so they
  adopt it and carry on (shared/dataset.py).

Any key of the job that something wrote into the emptied Redis before it paused (services
pause on a lost dataset, but a step in progress may finish) is deleted first.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass

import redis
from redis.client import Pipeline

from shared import keys
from shared.bus import Bus
from shared.dataset import new_dataset, read_dataset
from shared.fence import max_epoch
from shared.folders import MANIFEST, data_prefix
from shared.job import JobRecord, JobState, JobTaken, insert_job
from shared.ledger import init_ledger
from shared.policy import init_pointer
from shared.schema import decode_heartbeat
from shared.store import ObjectStore, StoreError

log = logging.getLogger(__name__)
JOB_FILE = "job.json"
DELETED_FILE = "deleted.json"


def job_file(job_id: str) -> str:
    return f"jobs/{job_id}/{JOB_FILE}"


def save_job_copy(store: ObjectStore, rec: JobRecord) -> None:
    """The store's copy of a new job (what recovery registers again)."""
    store.put(job_file(rec.id), rec.model_dump_json().encode())


def mark_deleted(store: ObjectStore, job_id: str) -> None:
    """A job deleted on purpose: its folder (kept unless purged) is not an orphan."""
    store.put(f"jobs/{job_id}/{DELETED_FILE}", b"{}")


@dataclass
class Orphan:
    job_id: str
    recoverable: bool
    reason: str  # why not recoverable ("" when it is)
    checkpoint_step: int  # -1: none
    groups_trained: int
    steps: int


def _newest_checkpoint(store: ObjectStore, job_id: str) -> tuple[int, int]:
    """(step, groups trained) of the newest checkpoint whose state.json matches its manifest."""
    steps = sorted(
        (
            int(k.split("/")[3][5:])
            for k in store.list(f"jobs/{job_id}/trainer/")
            if k.endswith("/" + MANIFEST) and k.count("/") == 4 and k.split("/")[3].startswith("step-")
        ),
        reverse=True,
    )
    for step in steps:
        prefix = f"jobs/{job_id}/trainer/step-{step:08d}"
        try:
            manifest = json.loads(store.get(f"{prefix}/{MANIFEST}"))
            raw = store.get(f"{data_prefix(prefix, manifest.get('data_dir', ''))}/state.json")
            if hashlib.sha256(raw).hexdigest() != manifest["files"]["state.json"]:
                continue
            return step, int(json.loads(raw).get("data", {}).get("groups_trained", 0))
        except (StoreError, ValueError, KeyError, TypeError):
            continue
    return -1, 0


def orphaned_jobs(r: redis.Redis, store: ObjectStore) -> list[Orphan]:
    known = {k.decode() for k in r.hkeys(keys.jobs_index())}
    out = []
    for job_id in store.list_dirs("jobs/"):
        if job_id in known or store.exists(f"jobs/{job_id}/{DELETED_FILE}"):
            continue
        step, trained = _newest_checkpoint(store, job_id)
        try:
            rec = JobRecord.model_validate_json(store.get(job_file(job_id)))
            out.append(Orphan(job_id, True, "", step, trained, rec.spec.steps))
        except (StoreError, ValueError) as e:
            out.append(Orphan(job_id, False, f"no readable {JOB_FILE} in the store ({e})", step, trained, 0))
    return out


def recover_jobs(r: redis.Redis, store: ObjectStore, job_ids: list[str] | None = None) -> list[str]:
    """Register orphaned jobs again (all recoverable ones, or those named). Returns their ids."""
    done = []
    for o in orphaned_jobs(r, store):
        if not o.recoverable or (job_ids is not None and o.job_id not in job_ids):
            continue
        rec = JobRecord.model_validate_json(store.get(job_file(o.job_id)))
        finished = o.checkpoint_step >= rec.spec.steps
        rec.state = JobState.completed if finished else JobState.running
        rec.error = (
            f"recovered from the store after Redis lost it: resumes at checkpoint step {max(0, o.checkpoint_step)}"
        )
        # Whatever was written into the emptied Redis for this job since (a late metric point, a
        # lease) goes first: the job starts again from the store alone.
        for key in list(r.scan_iter(match=keys.job_key_pattern(rec.id), count=500)):
            r.delete(key)
        Bus.ensure_groups(r, rec.id)
        epoch = max_epoch(store, rec.id)

        def keys_beside(pipe: Pipeline, o: Orphan = o, rec: JobRecord = rec, epoch: int = epoch) -> None:
            init_pointer(pipe, rec.id, o.checkpoint_step)
            pipe.set(keys.trainer_epoch(rec.id), epoch)
            init_ledger(pipe, rec.id, o.groups_trained)

        try:
            insert_job(r, rec, also=keys_beside, active=rec.state != JobState.completed)
        except JobTaken:  # registered meanwhile (another recover call): never over it
            log.warning("job %s: registered meanwhile; left as it is", rec.id)
            continue
        log.warning("job %s: registered again from the store (%s)", rec.id, asdict(o))
        done.append(rec.id)
    # Services that remember the lost dataset carry on with the recovered one.
    remembered = set()
    for key in r.scan_iter(match=keys.service_pattern(), count=500):
        raw = r.get(key)
        if raw:
            try:
                remembered.add(decode_heartbeat(raw).dataset)
            except ValueError:
                continue
    cur = read_dataset(r)
    if cur:
        remembered.add(cur["id"])
    new_dataset(r, supersedes=sorted(x for x in remembered if x), force=True)
    return done
