"""Policy-version retention (services/trainer/retention.py): the last N, every Kth, the
evaluated best, and nothing in use is ever deleted. Real Redis, real file:// store."""

from __future__ import annotations

from pathlib import Path

import redis

from services.trainer.retention import Retention, prune_versions, stored_versions, versions_to_delete
from shared.metrics import record_eval
from shared.policy import Manifest, fetch_version, publish_version
from shared.store import FileStore
from tests.support.heartbeats import fake_heartbeat

JOB = "keep-1"


def test_the_policy_keeps_last_every_kth_best_and_in_use():
    vs = list(range(1, 31))
    gone = versions_to_delete(vs, Retention(keep_last=4, keep_every=10), in_use={3, 22}, best=7)
    assert set(vs) - set(gone) == {3, 7, 10, 20, 22, 27, 28, 29, 30}
    assert versions_to_delete(vs, Retention(keep_last=0, keep_every=10), in_use=set(), best=None) == []
    assert versions_to_delete([1, 2], Retention(keep_last=4, keep_every=0), in_use=set(), best=None) == []


def test_pruning_the_store_spares_what_rollout_serves_and_checkpoints_name(tmp_path: Path, r: redis.Redis):
    store = FileStore(tmp_path / "store")
    for v in range(1, 31):
        publish_version(store, Manifest(job_id=JOB, version=v, step=v, base_model="m", files={}), {"a": b"x" * v})
    record_eval(r, JOB, 7, {"pass@1": 0.9, "accuracy": 0.9})
    record_eval(r, JOB, 12, {"pass@1": 0.4, "accuracy": 0.4})
    fake_heartbeat(r, "r0", policy_versions={JOB: 22})
    gone = prune_versions(store, r, JOB, Retention(keep_last=4, keep_every=10), checkpoint_steps=[3])
    assert set(stored_versions(store, JOB)) == {3, 7, 10, 20, 22, 27, 28, 29, 30}
    assert set(gone).isdisjoint(stored_versions(store, JOB))
    assert not list((tmp_path / "store" / "jobs" / JOB / "policy" / "v5").glob("*"))  # no half-deleted folder
    for v in stored_versions(store, JOB):  # what is left is whole and verifies
        fetch_version(store, JOB, v, tmp_path / f"v{v}")
