"""Issue 47 item 2: ids unique by construction. Creating a job never overwrites one: the create is
atomic and fails on a taken id, and the api draws a fresh suffix. Real Redis, the real api app
(in-process, and on uvicorn for concurrent submissions), a real file store.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.api import jobs
from services.api.recovery import orphaned_jobs, recover_jobs, save_job_copy
from shared import keys
from shared.job import JobRecord, JobSpec, JobState, JobTaken, insert_job, load_job
from shared.metrics import read_ledger
from shared.policy import read_pointer
from shared.store import open_store
from tests.support.api import api_client
from tests.support.api import served as serve

TOKEN = "ids-test-token-0123456789abcd"


def _fixed(*suffixes: str):  # noqa: ANN202
    """A random source that draws these suffixes, in order."""
    it = iter(suffixes)
    return lambda: next(it)


def test_a_forced_collision_leaves_the_old_job_untouched(r, tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    spec = JobSpec(name="same", base_model="m", eval_size=0)
    old = jobs.create_job(r, spec=spec, store=store, suffix=_fixed("aaaaaa"))
    save_job_copy(store, old)
    assert old.id == "same-aaaaaa"
    # The old job lives on: paused, fed, a version published.
    jobs.transition(r, job_id=old.id, action="pause")
    r.hincrby(keys.ledger(old.id), "fed", 16)
    r.set(keys.policy_pointer(old.id), 3)
    before = (r.hget(keys.jobs_index(), old.id), read_ledger(r, old.id), read_pointer(r, old.id))
    copy = store.get(f"jobs/{old.id}/job.json")

    new = jobs.create_job(r, spec=spec, store=store, suffix=_fixed("aaaaaa", "bbbbbb"))
    assert new.id == "same-bbbbbb"
    assert (r.hget(keys.jobs_index(), old.id), read_ledger(r, old.id), read_pointer(r, old.id)) == before
    assert load_job(r, old.id).state == JobState.paused
    assert store.get(f"jobs/{old.id}/job.json") == copy
    assert r.sismember(keys.active_jobs(), new.id) and read_pointer(r, new.id) == 0


def test_an_id_the_store_still_holds_is_passed_over(r, tmp_path):
    """A job Redis lost (an orphan) or one deleted with its artifacts kept: a new job under its
    id would take over its checkpoints and versions."""
    store = open_store(f"file://{tmp_path / 'store'}")
    store.put("jobs/same-cccccc/trainer/step-00000004/manifest.json", b"{}")
    new = jobs.create_job(r, spec=JobSpec(name="same", base_model="m"), store=store, suffix=_fixed("cccccc", "dddddd"))
    assert new.id == "same-dddddd"
    assert not r.hexists(keys.jobs_index(), "same-cccccc")


def test_insert_job_refuses_a_taken_id_and_writes_nothing(r):
    now = 1.0
    rec = JobRecord(id="x-1", spec=JobSpec(base_model="m"), state=JobState.running, created_at=now, updated_at=now)
    insert_job(r, rec)
    other = rec.model_copy(update={"state": JobState.paused, "created_at": 2.0})
    with pytest.raises(JobTaken):
        insert_job(r, other, also=lambda pipe: pipe.set(keys.policy_pointer("x-1"), 9))
    assert load_job(r, "x-1").state == JobState.running and r.get(keys.policy_pointer("x-1")) is None
    assert r.zcard(keys.jobs_by_created()) == 1


def test_recovery_never_registers_over_a_job_created_meanwhile(r, tmp_path, monkeypatch):
    from services.api import recovery

    store = open_store(f"file://{tmp_path / 'store'}")
    lost = JobRecord(id="lost-000001", spec=JobSpec(base_model="m"), created_at=1.0, updated_at=1.0)
    save_job_copy(store, lost)
    seen = orphaned_jobs(r, store)  # the orphan check: Redis does not know the job
    assert [o.job_id for o in seen] == [lost.id]
    # Between the check and the registration, a job of that id is created (another recover call).
    now = 2.0
    insert_job(r, JobRecord(id=lost.id, spec=JobSpec(base_model="m2"), created_at=now, updated_at=now))
    monkeypatch.setattr(recovery, "orphaned_jobs", lambda *_: seen)  # the registration acts on what it saw
    assert recover_jobs(r, store) == []
    assert load_job(r, lost.id).spec.base_model == "m2"


def test_concurrent_same_name_submissions_give_as_many_jobs(r, redis_server, monkeypatch):
    """100 concurrent POSTs of one name over real HTTP, with the random source narrowed to 256
    suffixes so that ids do collide: 100 distinct jobs, each with its own record."""
    monkeypatch.setattr(jobs, "_suffix", lambda: f"{jobs.secrets.randbelow(256):02x}")
    with api_client(redis_server.url, TOKEN) as client, serve(client.app) as url:

        def submit(_: int) -> str:
            resp = httpx.post(
                f"{url}/v1/jobs",
                json={"name": "same", "base_model": "m", "eval_size": 0},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=60,
            )
            assert resp.status_code == 201, resp.text
            return resp.json()["id"]

        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(submit, range(100)))
    assert len(set(ids)) == 100
    assert r.hlen(keys.jobs_index()) == 100 and r.zcard(keys.jobs_by_created()) == 100
    for job_id in ids:
        assert json.loads(r.hget(keys.jobs_index(), job_id))["id"] == job_id


def test_a_name_whose_ids_are_all_taken_is_refused_not_overwritten(r):
    spec = JobSpec(name="full", base_model="m")
    jobs.create_job(r, spec=spec, suffix=lambda: "000000")
    with pytest.raises(JobTaken, match="all taken"):
        jobs.create_job(r, spec=spec, suffix=itertools.repeat("000000").__next__)
    assert r.hlen(keys.jobs_index()) == 1


def test_backlog_segment_ids_are_unique_even_at_one_instant(r, monkeypatch):
    """Spillers on several replicas name segments; a folder written under a taken name would
    overwrite another segment's groups. With the clock stopped (or two replicas in the same
    nanosecond), 20,000 ids drawn by 8 threads are still all distinct, and still carry their time."""
    import types

    from services.rollout.spill import _created
    from shared import segments

    monkeypatch.setattr(segments, "time", types.SimpleNamespace(time_ns=lambda: 1_700_000_000_000_000_000))
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: segments.new_segment_id(r, "job-1"), range(20_000)))
    assert len(set(ids)) == 20_000
    assert {_created(s) for s in ids} == {1_700_000_000.0}
