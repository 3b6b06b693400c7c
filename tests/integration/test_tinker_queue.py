"""The Tinker API's call queue on a real redis-server (shared/tinker_queue.py): seq_id rules, the
order the trainer reads, fenced results, and calls leaving only once a checkpoint holds them."""

from __future__ import annotations

import pytest

from shared import keys, tinker_queue
from shared.lease import Lease, LeaseLost
from shared.schema import TinkerCall, TinkerResult


@pytest.fixture(params=["redis", "cluster"])
def r(request, r):
    """Each test on one Redis and on a 3-master Redis Cluster (the same scripts, routed by slot)."""
    return r if request.param == "redis" else request.getfixturevalue("rc")


JOB = "tinker-0123456789-0"


def call(seq: int, lr: float = 1e-3) -> TinkerCall:
    return TinkerCall(
        job_id=JOB, seq=seq, kind="optim_step", request_id=tinker_queue.request_id(JOB, seq), adam={"learning_rate": lr}
    )


def test_seq_ids_repeat_refuse_and_fill_gaps(r) -> None:
    with pytest.raises(tinker_queue.SeqRefused, match="no Tinker model"):
        tinker_queue.enqueue_call(r, call(1), "d1")
    tinker_queue.init_model(r, JOB, first_seq=1)
    assert tinker_queue.enqueue_call(r, call(2), "d2") is True  # ahead of 1: taken (SDK chunks arrive out of order)
    assert tinker_queue.queue_state(r, JOB)["next"] == 1
    assert tinker_queue.enqueue_call(r, call(1), "d1") is True
    assert tinker_queue.queue_state(r, JOB)["next"] == 3  # the gap filled: both received
    assert tinker_queue.enqueue_call(r, call(1), "d1") is False  # the SDK retried: the same request
    with pytest.raises(tinker_queue.SeqRefused, match="already used by another request"):
        tinker_queue.enqueue_call(r, call(1, lr=0.5), "other")
    with pytest.raises(tinker_queue.SeqRefused, match="too far ahead"):
        tinker_queue.enqueue_call(r, call(3 + tinker_queue.SEQ_WINDOW), "far")
    got = tinker_queue.read_calls(r, {JOB: "0"}, block_ms=0)[JOB]
    assert [q.seq for q in got] == [2, 1]  # arrival order: the trainer applies by seq


def test_results_are_fenced_and_checkpointed_calls_leave(r) -> None:
    tinker_queue.init_model(r, JOB, first_seq=1)
    for s in (1, 2, 3):
        tinker_queue.enqueue_call(r, call(s), f"d{s}")
    entries = {q.seq: q.entry_id for q in tinker_queue.read_calls(r, {JOB: "0"}, block_ms=0)[JOB]}
    old = Lease(r, JOB, "old", ttl_s=30)
    assert old.acquire()
    tinker_queue.write_result(r, old.fence, TinkerResult(job_id=JOB, seq=1, metrics={"x": 1.0}))
    assert tinker_queue.read_result(r, JOB, 1).metrics == {"x": 1.0}
    assert r.lrange(keys.tinker_done(JOB, tinker_queue.request_id(JOB, 1)), 0, -1) == [b"1"]  # the long poll wakes
    tinker_queue.checkpointed(r, old.fence, JOB, 2, [entries[1], entries[2]])
    assert [q.seq for q in tinker_queue.read_calls(r, {JOB: "0"}, block_ms=0)[JOB]] == [3]
    assert tinker_queue.queue_state(r, JOB)["checkpointed"] == 2
    # Another trainer takes the lease over: the deposed one writes nothing more.
    r.delete(keys.trainer_lease(JOB))
    new = Lease(r, JOB, "new", ttl_s=30)
    assert new.acquire()
    with pytest.raises(LeaseLost):
        tinker_queue.write_result(r, old.fence, TinkerResult(job_id=JOB, seq=3, error="stale"))
    with pytest.raises(LeaseLost):
        tinker_queue.checkpointed(r, old.fence, JOB, 3, [entries[3]])
    assert tinker_queue.read_result(r, JOB, 3) is None
    assert [q.seq for q in tinker_queue.read_calls(r, {JOB: "0"}, block_ms=0)[JOB]] == [3]
