"""Redis Cluster (issue 47, item 5) on a real 3-master cluster started by the test: jobs whose keys
live on different masters read, settled and audited together; creating and deleting a job; the
start-up refusal of a REDIS_URL of the other kind; and the dataset guard reporting a failover and
a master back without its data. (test_bus.py and test_tinker_queue.py run their bodies on the
cluster too.)"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import redis

from services.api import jobs
from shared import keys
from shared.bus import FIELD, Bus, feed
from shared.dataset import DatasetGuard, new_dataset
from shared.job import JobSpec, load_job
from shared.ledger import audit, init_ledger
from shared.redis_conn import RedisPolicyError, check_server, connect
from shared.slots import by_slot
from tests.support.redis_cluster import RedisCluster
from tests.support.waits import Deadline


def _jobs_on_two_masters(r: redis.Redis, cluster: RedisCluster) -> tuple[str, str]:
    """Two job ids whose keys are served by different masters."""
    first, by_node = "", {}
    for i in range(100):
        job = f"c-{i:06d}"
        node = cluster.master_of_slot(r.keyslot(keys.ledger(job)))  # type: ignore[attr-defined]
        by_node.setdefault(node.port, job)
        if len(by_node) == 2:
            first, second = by_node.values()
            return first, second
    raise AssertionError(f"100 ids all on one master ({first})")


def _feed(r: redis.Redis, job: str, n: int) -> None:
    Bus.ensure_groups(r, job)
    pipe = r.pipeline(transaction=True)  # one job: one slot, so one MULTI
    init_ledger(pipe, job)
    pipe.execute()
    assert feed(r, job, 0, [f"{job}-p{i}".encode() for i in range(n)]) == n  # the feeder's script, on its slot


def test_jobs_on_different_masters_are_read_settled_and_audited_together(rc, redis_cluster):
    a, b = _jobs_on_two_masters(rc, redis_cluster)
    assert len(by_slot(rc, [keys.prompts(a), keys.prompts(b)])) == 2
    for job in (a, b):
        _feed(rc, job, 3)
    rollout = Bus(rc, keys.GROUP_ROLLOUT, "w1")
    got = rollout.read([keys.prompts(a), keys.prompts(b)], count=10, block_ms=100)
    assert sorted(e.data for e in got) == sorted(f"{j}-p{i}".encode() for j in (a, b) for i in range(3))
    # One settle batch across both jobs: each entry handed on once, counted in its own job's ledger.
    units = [(e, [(keys.rollouts(e.job_id), e.data)], {"produced": 1}) for e in got]
    assert rollout.settle_each(units) == [True] * 6
    assert rollout.settle_each(units) == [False] * 6  # at most once
    for job in (a, b):
        led = audit(rc, job)
        assert led.balanced, led.problems
        assert led.counters["produced"] == 3 and led.in_streams["rollouts"] == 3

    # A blocked read over both jobs wakes for an entry on either master.
    reward = Bus(rc, keys.GROUP_REWARD, "w2")
    reward.read([keys.rollouts(a), keys.rollouts(b)], count=10, block_ms=10)  # takes the 6 above
    late = threading.Timer(0.3, lambda: rc.xadd(keys.rollouts(b), {FIELD: b"late"}))
    late.start()
    got = reward.read([keys.rollouts(a), keys.rollouts(b)], count=10, block_ms=5000)
    late.join()
    assert [(e.job_id, e.data) for e in got] == [(b, b"late")]


def test_a_job_is_created_and_deleted_on_the_cluster(rc, tmp_path):
    from shared.store import open_store

    store = open_store(f"file://{tmp_path / 'store'}")
    rec = jobs.create_job(rc, spec=JobSpec(name="cl", base_model="m", eval_size=0), store=store)
    assert load_job(rc, rec.id) is not None and rc.sismember(keys.active_jobs(), rec.id)
    assert audit(rc, rec.id).balanced
    jobs.transition(rc, job_id=rec.id, action="cancel")
    out = jobs.delete_job(rc, job_id=rec.id, store=store)
    assert out["deleted_keys"] > 3  # its streams, ledger, pointer, creation mark ...
    assert list(rc.scan_iter(match=keys.job_key_pattern(rec.id))) == []
    assert load_job(rc, rec.id) is None and not rc.sismember(keys.active_jobs(), rec.id)


def test_a_redis_url_of_the_other_kind_is_refused_at_start(redis_cluster, redis_server):
    node = redis_cluster.nodes[0]
    with pytest.raises(RedisPolicyError, match=r"names one Redis .* Redis Cluster node .* redis\+cluster://"):
        check_server(connect(f"redis://127.0.0.1:{node.port}/0"))
    with pytest.raises(RedisPolicyError, match=r"names a Redis Cluster .* single Redis"):
        connect(f"redis+cluster://127.0.0.1:{redis_server.port}/0")
    assert check_server(connect(redis_cluster.url)) == []  # the right kind: AOF on, noeviction


def _wait(pred, what: str, timeout: float = 60):  # noqa: ANN001, ANN202
    deadline = Deadline(timeout)
    while not (got := pred()):
        assert deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


def _check(guard: DatasetGuard) -> str:
    try:
        return guard.check()
    except redis.RedisError:  # slots not served yet (CLUSTERDOWN) while the cluster fails over
        return ""


def test_a_failover_is_reported_like_a_lost_dataset_until_recovered(tmp_path):
    cluster = RedisCluster(tmp_path / "failover", masters=3, replicas=1)
    try:
        cluster.start()
        _wait(lambda: sum("slave" in line for line in cluster.nodes[0].cli("CLUSTER", "NODES").splitlines()) == 3,
              "replicas attached")  # fmt: skip
        r = connect(cluster.url)
        guard = DatasetGuard(r)
        started_on = guard.attach()
        assert guard.check() == "" and len(guard.masters) == 3
        victim = cluster.master_of_slot(r.keyslot(keys.jobs_index()))  # type: ignore[attr-defined]
        _wait(lambda: victim.cli("INFO", "replication").count("state=online") == 1, "the replica in sync")
        cluster.kill(victim)
        why = _wait(lambda: _check(guard), "the failover to be reported", timeout=90)
        assert f"started on dataset {started_on}" in why and "failover promoted a replica" in why
        assert "burstrl recover" in why
        # Recovery writes an id that supersedes ours: the guard adopts it, with the cluster as it is now.
        new_dataset(r, supersedes=[started_on], force=True)
        assert _check(guard) == "" and guard.id != started_on
        assert _check(guard) == ""
    finally:
        cluster.stop()


def test_a_master_back_without_its_data_is_reported(tmp_path):
    cluster = RedisCluster(tmp_path / "empty", masters=3)
    try:
        cluster.start()
        r = connect(cluster.url)
        guard = DatasetGuard(r)
        guard.attach()
        rng, marker = next((rng, key) for rng, key in guard.markers.items() if rng[0] > 0)
        node = cluster.master_of_slot(rng[0])
        cluster.kill(node)
        shutil.rmtree(node.dir / "appendonlydir")  # its AOF gone; its nodes.conf (slots, id) kept
        cluster.restart(node)
        why = _wait(lambda: _check(guard), "the empty master to be reported")
        assert f"marker of slots {rng[0]}-{rng[1]} ({marker}) is missing" in why
    finally:
        cluster.stop()
