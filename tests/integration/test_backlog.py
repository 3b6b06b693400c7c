"""The backlog's disk tier against a real Redis and a file:// store, in-process: the spec block,
spilling exactly once, the trainer's sources (order, acknowledgement, restart), refusal of
corrupt segments, age drops, the feeder's budget and rollout's reasons."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from services.api.feeder import Feeder
from services.trainer.admit import too_old
from services.trainer.sources import SegmentRef
from shared import keys
from shared.backlog import feed_room, mark_done, read_index
from shared.bus import Bus
from shared.job import JobSpec, JobState, load_job
from shared.lease import Lease, LeaseLost
from shared.ledger import audit
from shared.metrics import read_ledger, read_points
from shared.schema import decode_dead
from shared.segments import DATA, SegmentRefused, read_segment, segment_prefix, stored_segments
from shared.store import FileStore
from tests.support.backlog import Drain, group, group_ids_of, new_job, push_ready, runtime, spec, spiller


@pytest.fixture
def store(tmp_path) -> FileStore:
    return FileStore(tmp_path / "store")


def _balanced(r, job_id: str) -> None:
    a = audit(r, job_id)
    assert a.balanced, a.problems


# -- the spec -----------------------------------------------------------------------
def test_backlog_is_off_by_default_and_every_field_is_bounded():
    s = JobSpec(base_model="m")
    assert not s.backlog.enabled and s.backlog.order == "oldest"
    for bad in (
        {"max_groups": -1},
        {"max_groups": 10**9},
        {"max_bytes": 10},
        {"max_age_hours": float("nan")},
        {"max_age_hours": float("inf")},
        {"max_age_hours": 0},
        {"order": "random"},
        {"segment_groups": 0},
        {"segment_groups": 10_000},
        {"surprise": 1},
    ):
        with pytest.raises(ValidationError) as e:
            JobSpec(base_model="m", backlog=bad)
        assert e.value.errors()[0]["loc"][:1] == ("backlog",), (bad, e.value.errors())
    with pytest.raises(ValidationError, match="segment_groups"):
        JobSpec(base_model="m", backlog={"max_groups": 10, "segment_groups": 64})
    with pytest.raises(ValidationError, match="max_age_versions"):
        JobSpec(base_model="m", max_staleness=8, backlog={"max_groups": 100, "max_age_versions": 4})
    schema = JobSpec.model_json_schema()
    assert "max_age_hours" in schema["$defs"]["BacklogSpec"]["properties"]  # documented in the OpenAPI schema
    assert schema["$defs"]["BacklogSpec"]["properties"]["order"]["description"].startswith("Which groups")


def test_the_api_refuses_a_bad_backlog_with_422_naming_the_field(r, redis_server):
    from fastapi.testclient import TestClient

    from services.api.app import build_routes
    from services.api.settings import ApiSettings
    from shared.service import ServiceRuntime

    rt = ServiceRuntime("api", ApiSettings(redis_url=redis_server.url, dev=True))
    build_routes(rt)
    with TestClient(rt.app) as c:
        resp = c.post("/v1/jobs", json={"base_model": "m", "backlog": {"max_groups": 100, "order": "newest"}})
        assert resp.status_code == 422
        assert resp.json()["detail"][0]["loc"][-2:] == ["backlog", "order"]


# -- spilling ----------------------------------------------------------------------
def test_beyond_the_hot_window_groups_spill_once_and_the_ledger_balances(r, redis_server, store):
    rec = new_job(r, spec())  # hot window: (1 + 1) x 4 = 8
    push_ready(r, rec.id, [group(rec.id, i) for i in range(40)])
    sp = spiller(runtime(redis_server.url), store)
    assert sp.tick() == 32  # 40 - 8 hot, in segments of 8
    index = read_index(r, rec.id)
    assert len(index) == 4 and all(i.groups == i.remaining == 8 for i in index.values())
    assert sorted(stored_segments(store, rec.id)) == sorted(index)
    led = read_ledger(r, rec.id)
    assert led["spilled"] == 32 and led["in_flight"] == 40
    _balanced(r, rec.id)
    assert sp.tick() == 0  # the hot window stays in Redis
    # The oldest groups went to disk, in stream order.
    first = read_segment(store, rec.id, next(iter(index)))
    assert group_ids_of(first) == [f"{rec.id}:g{i}" for i in range(8)]
    assert audit(r, rec.id).in_backlog == 32


def test_a_spill_whose_entries_were_taken_over_is_never_indexed(r, redis_server, store):
    """The trainer took an entry from a stalled spiller: the segment must not be indexed, or that
    group would be trained from the stream and from the segment."""
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(16)])
    bus = Bus(r, keys.GROUP_TRAINER, "spill-r1")
    entries = bus.read_new(keys.ready(rec.id), count=8)
    trainer = Bus(r, keys.GROUP_TRAINER, "trainer", redo_own_pending=False)
    r.xclaim(keys.ready(rec.id), keys.GROUP_TRAINER, "trainer", 0, [entries[0].id])
    assert bus.spill(entries, "seg-x", '{"groups": 8, "remaining": 8}') == 0
    assert read_index(r, rec.id) == {} and read_ledger(r, rec.id).get("spilled", 0) == 0
    assert r.xpending(keys.ready(rec.id), keys.GROUP_TRAINER)["pending"] == 8  # nothing acknowledged
    # The spiller's own 7 are spilled on its next pass (a smaller segment); the trainer keeps its one.
    sp = spiller(runtime(redis_server.url), store)
    assert sp.spill_pass(rec) == 7
    assert trainer.read_own(keys.ready(rec.id), count=10)[0].id == entries[0].id
    _balanced(r, rec.id)


def test_a_dead_spillers_entries_are_taken_over_by_another(r, redis_server, store):
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(24)])
    dead = Bus(r, keys.GROUP_TRAINER, "spill-gone")  # its replica never heartbeats
    taken = dead.read_new(keys.ready(rec.id), count=8)
    time.sleep(2.1)  # the bus never snatches an entry delivered less than 2 s ago
    sp = spiller(runtime(redis_server.url, replica="r2"), store, replica="r2")
    assert sp.spill_pass(rec) == 16  # the dead one's 8 first, then 8 beyond the hot window
    seg = next(iter(read_index(r, rec.id)))  # the oldest segment
    assert group_ids_of(read_segment(store, rec.id, seg)) == [f"{rec.id}:g{i}" for i in range(8)]
    assert len(taken) == 8
    _balanced(r, rec.id)


# -- the trainer's sources -----------------------------------------------------------
@pytest.mark.parametrize("order", ["oldest", "freshest"])
def test_the_trainer_takes_segments_and_stream_in_the_jobs_order_each_once(r, redis_server, store, order):
    rec = new_job(r, spec(order=order))
    push_ready(r, rec.id, [group(rec.id, i) for i in range(40)])
    spiller(runtime(redis_server.url), store).tick()
    d = Drain(r, store, rec)
    got = d.all(40)
    d.close()
    ids = [int(g.rsplit("g", 1)[1]) for g in got]
    assert sorted(ids) == list(range(40))  # every group once
    if order == "oldest":
        assert ids == list(range(40))  # segments (the oldest) first, in order, then the hot stream
    else:
        assert ids[:8] == list(range(32, 40))  # the hot stream first
        assert ids[8:16] == list(range(31, 23, -1))  # then the newest segment, newest group first
    led = read_ledger(r, rec.id)
    assert led["trained"] == 40 and led["in_flight"] == 0 and led["backlog_done"] == 32
    assert read_index(r, rec.id) == {} and stored_segments(store, rec.id) == []  # finished segments deleted
    _balanced(r, rec.id)


def test_a_restarted_trainer_skips_what_was_acknowledged_and_gets_back_the_rest(r, redis_server, store):
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(24)])
    spiller(runtime(redis_server.url), store).tick()  # 16 on disk
    d = Drain(r, store, rec)
    first = d.take(4)
    d.src.ack([ref for ref, _ in first], "trained")  # a checkpoint held these
    d.take(3)  # trained, never checkpointed: the process dies
    d.close()
    seg = next(iter(read_index(r, rec.id)))
    assert read_index(r, rec.id)[seg].remaining == 4
    d2 = Drain(r, store, rec)
    got = [g.group_id for _, g in d2.take(8)]
    assert got == [f"{rec.id}:g{i}" for i in range(4, 8)] + [f"{rec.id}:g{i}" for i in range(8, 12)]
    # Acknowledging twice counts once (the done bitmap), as XACK does for stream entries.
    refs = [ref for ref, _ in d2.take(2)]
    d2.src.ack(refs, "trained")
    d2.src.ack(refs, "trained")
    assert read_ledger(r, rec.id)["trained"] == 6
    d2.close()
    _balanced(r, rec.id)


def test_only_the_lease_holder_acknowledges_segment_groups(r, redis_server, store):
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(16)])
    spiller(runtime(redis_server.url), store).tick()
    seg = next(iter(read_index(r, rec.id)))
    a = Lease(r, rec.id, "a", ttl_s=30)
    assert a.acquire()
    fence = a.fence
    r.delete(keys.trainer_lease(rec.id))  # A's lease expired; B took over
    b = Lease(r, rec.id, "b", ttl_s=30)
    assert b.acquire()
    with pytest.raises(LeaseLost):
        mark_done(r, rec.id, seg, [0, 1], "trained", fence=fence)
    assert mark_done(r, rec.id, seg, [0, 1], "trained", fence=None) == (0, False)  # rollout: a trainer holds it
    assert mark_done(r, rec.id, seg, [0, 1], "trained", fence=b.fence) == (2, False)
    assert read_ledger(r, rec.id)["trained"] == 2
    _balanced(r, rec.id)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_corrupt_segment_is_refused_dead_lettered_and_never_trained(r, redis_server, store, damage):
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(24)])
    spiller(runtime(redis_server.url), store).tick()
    bad = next(iter(read_index(r, rec.id)))
    path = store.root / segment_prefix(rec.id, bad) / DATA
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        path.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
    else:
        path.unlink()
    for info in (None, read_index(r, rec.id)[bad]):  # checked against the manifest, or the index's copy of its sha256
        with pytest.raises(SegmentRefused):
            read_segment(store, rec.id, bad, info)
    d = Drain(r, store, rec)
    got = d.all(16, timeout=20)
    d.close()
    assert sorted(got) == sorted(f"{rec.id}:g{i}" for i in range(8, 24))  # the corrupt segment's 8: never
    led = read_ledger(r, rec.id)
    assert led["dead"] == 8 and led["segments_refused"] == 1 and led["trained"] == 16 and led["in_flight"] == 0
    reasons = {decode_dead(f[b"m"]).reason for _, f in r.xrange(keys.dead_letter(rec.id))}
    assert len(reasons) == 1 and bad in reasons.pop()
    _balanced(r, rec.id)


def test_groups_past_the_age_limit_are_dropped_with_their_reason(r, redis_server, store):
    s = spec(max_age_versions=4, max_age_hours=1.0)
    old = group("j", 0, version=0, sampled_at=time.time() - 7200)
    assert too_old(old, s, version=1) == "dropped_age"  # hours
    assert too_old(group("j", 1, version=0), s, version=5) == "dropped_age"  # versions
    assert too_old(group("j", 2, version=1), s, version=5) == ""
    windowed = JobSpec(base_model="m", max_staleness=1)
    assert too_old(group("j", 3, version=0), windowed, version=2) == "dropped_stale"
    # Whole segments past the limit are dropped without reading them: by the trainer, or by
    # rollout while no trainer holds the job (so expired data never holds the budget).
    rec = new_job(r, s)
    push_ready(r, rec.id, [group(rec.id, i, sampled_at=time.time() - 7200) for i in range(24)])
    sp = spiller(runtime(redis_server.url), store)
    sp.tick()
    assert read_ledger(r, rec.id)["spilled"] == 16
    lease = Lease(r, rec.id, "t", ttl_s=30)
    assert lease.acquire()
    sp._clocks[rec.id].expire = 0
    sp.tick()
    assert len(read_index(r, rec.id)) == 2  # a trainer holds the job: rollout leaves its segments alone
    lease.release()
    sp._clocks[rec.id].expire = 0
    sp.tick()
    led = read_ledger(r, rec.id)
    assert read_index(r, rec.id) == {} and led["dropped_age"] == 16 and stored_segments(store, rec.id) == []
    _balanced(r, rec.id)


# -- the budget ---------------------------------------------------------------------
def test_windowed_jobs_keep_todays_window(r):
    rec = new_job(r, JobSpec(base_model="m", batch_size=4, max_staleness=1))
    assert feed_room(r, rec, {"in_flight": 0}) == (8, "")
    assert feed_room(r, rec, {"in_flight": 8})[0] == 0


def test_a_full_backlog_stops_the_feeder_and_rollout_says_why_dropping_nothing(r, redis_server, store):
    rec = new_job(r, spec(max_groups=16, segment_groups=8))
    feeder = Feeder(r, store)
    rt = runtime(redis_server.url)
    sp = spiller(rt, store)
    fed = feeder.tick()
    assert fed == 8 + 16  # the window plus the backlog
    assert feeder.tick() == 0
    sp.tick()
    ok, checks = rt.health.snapshot()
    assert ok  # degraded, not unready: other jobs are served, and a restart would fix nothing
    check = checks[f"backlog:{rec.id}"]
    assert not check["ok"] and check["scope"] == "job"
    assert rec.id in check["reason"] and "group budget" in check["reason"] and "max_groups" in check["reason"]
    led = read_ledger(r, rec.id)
    assert led["fed"] == 24 and not any(k.startswith("dropped") for k in led) and led.get("dead", 0) == 0
    _balanced(r, rec.id)


def test_the_byte_budget_stops_the_feeder(r, redis_server, store):
    rec = new_job(r, spec(max_groups=1000, max_bytes=1 << 20, segment_groups=8))
    push_ready(r, rec.id, [group(rec.id, i, tokens=2000) for i in range(120)])  # ~50 KB a group
    spiller(runtime(redis_server.url), store).tick()
    room, why = feed_room(r, rec, read_ledger(r, rec.id))
    assert room == 0 and "byte budget" in why and "max_bytes" in why


def test_a_budget_the_store_cannot_hold_fails_the_job_with_the_field(r, store):
    rec = new_job(r, spec(max_bytes=1 << 44))  # 16 TiB: more than this disk has
    assert Feeder(r, store).tick() == 0
    got = load_job(r, rec.id)
    assert got.state == JobState.failed and "backlog.max_bytes" in got.error


def test_the_hot_limit_keeps_the_backlog_out_of_redis_while_spilling_stalls(r, store):
    """No spiller (or a store outage): Redis holds at most the hot limit, rollout idles, says why."""
    rec = new_job(r, spec(max_groups=1000, segment_groups=8))
    feeder = Feeder(r, store)
    assert feeder.tick() == 8 + 3 * 8
    assert feeder.tick() == 0
    _, why = feed_room(r, rec, read_ledger(r, rec.id))
    assert "spilling is behind or paused" in why


def test_backlog_points_and_gauges(r, redis_server, store):
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i, sampled_at=time.time() - 1800) for i in range(40)])
    rt = runtime(redis_server.url)
    spiller(rt, store).tick()
    p = read_points(r, rec.id, "backlog")[-1]
    assert p["groups"] == 32 and p["segments"] == 4 and p["bytes"] > 0
    assert p["oldest_versions"] == 0 and 0.45 < p["oldest_hours"] < 0.6
    assert rt.registry.get_sample_value("burstrl_backlog_groups", {"job": rec.id}) == 32
    assert rt.registry.get_sample_value("burstrl_backlog_spilled_groups_total", {"job": rec.id}) == 32


def test_segment_refs_carry_their_bytes_and_a_stable_id():
    ref = SegmentRef("seg-1", 3, b"x")
    assert ref.id == "seg-1#3" and ref.data == b"x"


def test_a_segment_folder_holding_only_a_crashed_writes_temp_file_is_swept_once(r, store, redis_server, monkeypatch):
    """A spiller killed mid-write leaves jobs/{job}/backlog/{seg}/ holding only the file store's
    temporary file. Before, the sweep "deleted" that orphan on every pass and the folder stayed."""
    import os

    import services.rollout.spill as spill_mod
    from shared.segments import new_segment_id

    rec = new_job(r, spec())
    seg = new_segment_id(r, rec.id)
    folder = store.root / segment_prefix(rec.id, seg)
    folder.mkdir(parents=True)
    tmp = folder / ".tmp-crashed"
    tmp.write_bytes(b"half a segment")
    old = time.time() - 7200
    os.utime(tmp, (old, old))  # the write died two hours ago
    assert stored_segments(store, rec.id) == [seg]
    monkeypatch.setattr(spill_mod, "ORPHAN_AGE_S", 0.0)
    sp = spiller(runtime(redis_server.url), store)
    assert sp.sweep_orphans(rec.id) == 1
    assert not folder.exists() and stored_segments(store, rec.id) == []
    assert sp.sweep_orphans(rec.id) == 0  # nothing left to delete again
