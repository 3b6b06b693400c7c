"""The bus against a real redis-server."""

import time

import pytest

from shared import keys
from shared.bus import FIELD, Bus, trim_acked, trim_job
from shared.ledger import audit
from shared.metrics import read_ledger
from shared.redis_conn import RedisPolicyError, check_server
from shared.schema import decode_dead


@pytest.fixture(params=["redis", "cluster"])
def r(request, r):
    """Each test on one Redis and on a 3-master Redis Cluster (the same scripts, routed by slot)."""
    return r if request.param == "redis" else request.getfixturevalue("rc")


JOB = "t-1"


def _feed(r, n):
    Bus.ensure_groups(r, JOB)
    for i in range(n):
        r.xadd(keys.prompts(JOB), {FIELD: f"p{i}".encode()})


def test_forward_is_atomic_and_acks(r):
    _feed(r, 3)
    bus = Bus(r, keys.GROUP_ROLLOUT, "c1")
    entries = bus.read([keys.prompts(JOB)], count=10, block_ms=100)
    assert [e.data for e in entries] == [b"p0", b"p1", b"p2"]
    for e in entries:
        bus.forward([e], [(keys.rollouts(JOB), b"g")], {JOB: {"produced": 1}})
    with pytest.raises(ValueError, match="exactly one input"):
        bus.forward(entries, [(keys.rollouts(JOB), b"g")] * 3)
    assert r.xlen(keys.rollouts(JOB)) == 3
    assert r.xpending(keys.prompts(JOB), keys.GROUP_ROLLOUT)["pending"] == 0
    assert read_ledger(r, JOB)["produced"] == 3


def test_dead_consumer_entries_are_reclaimed_once(r):
    _feed(r, 2)
    dead = Bus(r, keys.GROUP_ROLLOUT, "dead", claim_idle_ms=50)
    assert len(dead.read([keys.prompts(JOB)], count=10, block_ms=100)) == 2  # read, never acked
    import time

    time.sleep(0.1)
    alive = Bus(r, keys.GROUP_ROLLOUT, "alive", claim_idle_ms=50)
    got = alive.read([keys.prompts(JOB)], count=10, block_ms=100)
    assert sorted(e.data for e in got) == [b"p0", b"p1"]
    alive.ack(got)
    assert alive.read([keys.prompts(JOB)], count=10, block_ms=100) == []


def test_poison_entry_is_dead_lettered_and_stage_goes_on(r):
    _feed(r, 1)
    bus = Bus(r, keys.GROUP_ROLLOUT, "c", claim_idle_ms=1, max_deliveries=3)
    import time

    for _ in range(3):  # a handler that crashes every time: read, never ack
        bus._last_claim = 0
        bus.read([keys.prompts(JOB)], count=1, block_ms=50)
        time.sleep(0.01)
    bus._last_claim = 0
    assert bus.read([keys.prompts(JOB)], count=1, block_ms=50) == []
    dead = r.xrange(keys.dead_letter(JOB))
    assert len(dead) == 1
    d = decode_dead(dead[0][1][FIELD])
    assert d.payload == b"p0" and "delivered 3 times" in d.reason
    assert read_ledger(r, JOB)["dead"] == 1


def test_eviction_policy_is_refused(r):
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(RedisPolicyError, match="noeviction"):
            check_server(r)
    finally:
        r.config_set("maxmemory-policy", "noeviction")
    assert any("AOF" in w for w in check_server(r)) is False  # our server runs with AOF on


def _flow(r, n):
    """Feed n groups the way the feeder does (XADD + fed in one step)."""
    Bus.ensure_groups(r, JOB)
    pipe = r.pipeline(transaction=True)
    for i in range(n):
        pipe.xadd(keys.prompts(JOB), {FIELD: f"g{i}".encode()})
    pipe.hincrby(keys.ledger(JOB), "fed", n)
    pipe.execute()


def test_settle_is_at_most_once_when_a_slow_consumer_wakes_up(r):
    _flow(r, 1)
    slow = Bus(r, keys.GROUP_ROLLOUT, "slow", claim_idle_ms=20)
    [e_slow] = slow.read([keys.prompts(JOB)], count=1, block_ms=50)
    time.sleep(0.05)  # "slow" looks dead: another replica reclaims and hands it on
    fast = Bus(r, keys.GROUP_ROLLOUT, "fast", claim_idle_ms=20)
    [e_fast] = fast.read([keys.prompts(JOB)], count=1, block_ms=50)
    assert e_fast.id == e_slow.id
    assert fast.forward([e_fast], [(keys.rollouts(JOB), b"out")], {JOB: {"produced": 1}}) == 1
    # The slow one finishes too: nothing is handed on twice, nothing counted twice.
    assert slow.forward([e_slow], [(keys.rollouts(JOB), b"out")], {JOB: {"produced": 1}}) == 0
    assert r.xlen(keys.rollouts(JOB)) == 1
    assert read_ledger(r, JOB)["produced"] == 1
    assert audit(r, JOB).balanced


def test_settle_each_says_which_units_were_handed_on_now(r):
    """What a stage reports as handed on must be what it handed on: a unit another replica
    settled first is not (issue 18: reward and rollout counted skipped groups)."""
    _flow(r, 3)
    slow = Bus(r, keys.GROUP_ROLLOUT, "slow", claim_idle_ms=20)
    mine = slow.read([keys.prompts(JOB)], count=3, block_ms=50)
    time.sleep(0.05)
    fast = Bus(r, keys.GROUP_ROLLOUT, "fast", claim_idle_ms=20)
    taken = fast.read([keys.prompts(JOB)], count=1, block_ms=50)
    assert fast.settle_each([(taken[0], [(keys.rollouts(JOB), b"out")], {"produced": 1})]) == [True]
    flags = slow.settle_each([(e, [(keys.rollouts(JOB), b"out")], {"produced": 1}) for e in mine])
    assert flags == [e.id != taken[0].id for e in mine] and flags.count(True) == 2
    assert read_ledger(r, JOB)["produced"] == 3 and r.xlen(keys.rollouts(JOB)) == 3


def test_batch_ack_needs_one_count_per_entry(r):
    _flow(r, 2)
    bus = Bus(r, keys.GROUP_ROLLOUT, "c")
    entries = bus.read([keys.prompts(JOB)], count=10, block_ms=50)
    with pytest.raises(ValueError, match="one each"):
        bus.ack(entries, {JOB: {"trained": 1}})
    assert bus.ack(entries, {JOB: {"trained": 2}}) == 2
    assert read_ledger(r, JOB)["trained"] == 2


def test_trim_never_drops_pending_or_undelivered(r):
    _flow(r, 10)
    bus = Bus(r, keys.GROUP_ROLLOUT, "c")
    got = bus.read([keys.prompts(JOB)], count=6, block_ms=50)  # 6 pending, 4 undelivered
    bus.ack([got[0], got[2], got[4]], {JOB: {"trained": 3}})
    assert trim_acked(r, keys.prompts(JOB)) == 1  # only g0: g1 is still pending
    assert [f[FIELD] for _, f in r.xrange(keys.prompts(JOB))] == [f"g{i}".encode() for i in range(1, 10)]
    bus.ack([got[1], got[3], got[5]], {JOB: {"trained": 3}})
    assert trim_acked(r, keys.prompts(JOB)) == 5  # g1..g5; g6..g9 were never delivered
    rest = bus.read([keys.prompts(JOB)], count=10, block_ms=50)
    assert [e.data for e in rest] == [f"g{i}".encode() for i in range(6, 10)]
    bus.ack(rest, {JOB: {"trained": 4}})
    assert trim_acked(r, keys.prompts(JOB)) == 4 and r.xlen(keys.prompts(JOB)) == 0
    assert audit(r, JOB).balanced


def test_trim_respects_the_slowest_group(r):
    stream = keys.dead_letter(JOB)  # any stream: two groups read it at their own pace
    for g in ("a", "b"):
        r.xgroup_create(stream, g, id="0", mkstream=True)
    ids = [r.xadd(stream, {FIELD: b"x"}) for _ in range(4)]
    fast = Bus(r, "a", "c")
    fast.read([stream], count=4, block_ms=50)
    r.xack(stream, "a", *ids)
    assert trim_acked(r, stream) == 0  # group b has not read anything yet
    assert trim_acked(r, "burstrl:{nosuch}:stream") == 0


def test_audit_catches_an_uncounted_ack(r):
    _flow(r, 3)
    bus = Bus(r, keys.GROUP_ROLLOUT, "c")
    entries = bus.read([keys.prompts(JOB)], count=3, block_ms=50)
    a = audit(r, JOB)
    assert a.balanced and a.in_streams["prompts"] == 3 and a.in_flight == 3
    r.xack(keys.prompts(JOB), keys.GROUP_ROLLOUT, entries[0].id)  # a stage that forgot its counter
    a = audit(r, JOB)
    assert not a.balanced and "in flight" in a.problems[0]


def test_ledger_balances_through_every_stage(r):
    _flow(r, 5)
    stages = [
        (keys.GROUP_ROLLOUT, keys.prompts(JOB), keys.rollouts(JOB), "produced"),
        (keys.GROUP_REWARD, keys.rollouts(JOB), keys.scored(JOB), "scored"),
        (keys.GROUP_REF, keys.scored(JOB), keys.ready(JOB), "refd"),
    ]
    for group, src, dst, counter in stages:
        bus = Bus(r, group, "c")
        for e in bus.read([src], count=10, block_ms=50):
            if e.data == b"g3":
                bus.dead_letter(e, "poison")
            else:
                bus.forward([e], [(dst, e.data)], {JOB: {counter: 1}})
            assert audit(r, JOB).balanced
    trainer = Bus(r, keys.GROUP_TRAINER, "t")
    ready = trainer.read([keys.ready(JOB)], count=10, block_ms=50)
    assert len(ready) == 4
    trainer.ack(ready[:1], {JOB: {"dropped_stale": 1}})
    trainer.ack(ready[1:], {JOB: {"trained": 3}})
    a = audit(r, JOB)
    assert a.balanced and a.in_flight == 0 and a.counters["dead"] == 1 == a.dead_stream_len
    assert trim_job(r, JOB) == 5 + 4 + 4 + 4


def test_a_large_batch_ack_counts_each_entry_once(r):
    _flow(r, 9000)  # beyond what one Lua unpack() can take (~8000): the ack is chunked
    bus = Bus(r, keys.GROUP_ROLLOUT, "c")
    entries = bus.read([keys.prompts(JOB)], count=9000, block_ms=50)
    assert bus.ack(entries, {JOB: {"trained": 9000}}) == 9000
    assert bus.ack(entries[:10], {JOB: {"trained": 10}}) == 0  # already acknowledged: not counted again
    assert read_ledger(r, JOB)["trained"] == 9000 and audit(r, JOB).balanced


def test_own_pending_entries_are_redone_without_waiting_for_the_idle_timeout(r):
    """After a Redis restart from an AOF that lost a settle, the entry is pending to us again."""
    _flow(r, 1)
    stage = Bus(r, keys.GROUP_ROLLOUT, "c")  # default claim idle: 2 minutes
    [e] = stage.read([keys.prompts(JOB)], count=1, block_ms=50)  # its output never lands
    stage._last_claim = 0  # the next maintenance pass (every few seconds)
    [again] = stage.read([keys.prompts(JOB)], count=1, block_ms=50)
    assert again.id == e.id
    holder = Bus(r, keys.GROUP_TRAINER, "t", redo_own_pending=False)  # keeps entries across reads
    stage.forward([again], [(keys.ready(JOB), b"g")], {JOB: {"produced": 1}})
    [held] = holder.read([keys.ready(JOB)], count=1, block_ms=50)
    holder._last_claim = 0
    assert holder.read([keys.ready(JOB)], count=1, block_ms=50) == [] and held


def test_entries_of_a_replica_whose_heartbeat_expired_are_taken_at_once(r):
    _flow(r, 4)
    alive = Bus(r, keys.GROUP_ROLLOUT, "alive")
    dead = Bus(r, keys.GROUP_ROLLOUT, "dead")
    held_alive = alive.read([keys.prompts(JOB)], count=2, block_ms=50)
    held_dead = dead.read([keys.prompts(JOB)], count=2, block_ms=50)
    r.set(keys.service("rollout", "alive"), b"{}", ex=60)  # only "alive" still heartbeats
    time.sleep(2.1)  # past the 2 s floor; far below the 2-minute idle timeout
    heir = Bus(r, keys.GROUP_ROLLOUT, "heir", heartbeat_role="rollout")
    got = heir.read([keys.prompts(JOB)], count=10, block_ms=50)
    assert sorted(e.id for e in got) == sorted(e.id for e in held_dead)
    assert not {e.id for e in got} & {e.id for e in held_alive}


def _consumers(r, stream, group):
    return {c["name"].decode(): int(c["pending"]) for c in r.xinfo_consumers(stream, group)}


def test_a_leaving_consumer_hands_its_pending_entries_to_a_live_peer(r):
    """A burst-side replica at the end of its burst: what it held is redone by a home replica,
    at once, and the consumer is gone from the group."""
    _flow(r, 4)
    stream = keys.prompts(JOB)
    home = Bus(r, keys.GROUP_ROLLOUT, "home", heartbeat_role="rollout")
    burst = Bus(r, keys.GROUP_ROLLOUT, "burst", heartbeat_role="rollout")
    assert len(home.read([stream], count=1, block_ms=50)) == 1
    held = burst.read([stream], count=3, block_ms=50)  # mid-round when the burst ends
    r.set(keys.service("rollout", "home"), b"{}", ex=60)
    r.set(keys.service("rollout", "burst"), b"{}", ex=60)  # still heartbeating while it leaves

    left = burst.leave([stream, keys.prompts("no-such-job")])
    assert (left.handed, left.held, left.left) == (3, 0, 1)
    assert _consumers(r, stream, keys.GROUP_ROLLOUT) == {"home": 4}
    # The peer redoes them from its own pending list on its next pass (no delivery counted).
    home._last_claim = 0
    got = home.read([stream], count=10, block_ms=50)
    assert {e.id for e in held} <= {e.id for e in got}
    pend = r.xpending_range(stream, keys.GROUP_ROLLOUT, "-", "+", 10, "home")
    assert {int(p["times_delivered"]) for p in pend if p["message_id"].decode() in {e.id for e in held}} == {2}
    for e in got:
        home.forward([e], [(keys.rollouts(JOB), b"g")], {JOB: {"produced": 1}})
    assert read_ledger(r, JOB)["produced"] == 4 and audit(r, JOB).balanced


def test_a_leaving_consumer_with_no_live_peer_keeps_its_entries_for_the_next_reader(r):
    _flow(r, 2)
    stream = keys.prompts(JOB)
    burst = Bus(r, keys.GROUP_ROLLOUT, "burst", heartbeat_role="rollout")
    r.set(keys.service("rollout", "burst"), b"{}", ex=60)
    held = burst.read([stream], count=2, block_ms=50)
    gone = Bus(r, keys.GROUP_ROLLOUT, "gone", heartbeat_role="rollout")
    assert gone.read([stream], count=1, block_ms=50) == []  # a consumer without a heartbeat: not a peer
    left = burst.leave([stream])
    assert (left.handed, left.held, left.left) == (0, 2, 0)  # never deleted while holding entries
    assert _consumers(r, stream, keys.GROUP_ROLLOUT)["burst"] == 2
    # Its heartbeat is gone (the process ended): the first replica to read takes them at once.
    r.delete(keys.service("rollout", "burst"))
    time.sleep(2.1)
    heir = Bus(r, keys.GROUP_ROLLOUT, "heir", heartbeat_role="rollout")
    got = heir.read([stream], count=10, block_ms=50)
    assert sorted(e.id for e in got) == sorted(e.id for e in held)
    assert burst.leave([stream]).left == 1  # holding nothing now: it can go
    assert "burst" not in _consumers(r, stream, keys.GROUP_ROLLOUT)


def test_a_holder_never_reclaims_or_dead_letters_its_own_pending_entries(r):
    """The trainer keeps entries pending until its checkpoint holds them: past claim_idle they are
    still its own, not a failed delivery. Before, each reclaim pass XAUTOCLAIMed them from itself
    (one more delivery each time) and at max_deliveries its own poison check dead-lettered groups
    it held in a partial batch, which it then trained anyway: counted dead and trained."""
    _flow(r, 3)
    stage = Bus(r, keys.GROUP_ROLLOUT, "c")
    for e in stage.read([keys.prompts(JOB)], count=3, block_ms=50):
        stage.forward([e], [(keys.ready(JOB), e.data)], {JOB: {"produced": 1}})
    holder = Bus(r, keys.GROUP_TRAINER, "trainer", claim_idle_ms=20, max_deliveries=3, redo_own_pending=False)
    held = holder.read([keys.ready(JOB)], count=2, block_ms=50)
    gone = Bus(r, keys.GROUP_TRAINER, "spill-gone", claim_idle_ms=20)  # another consumer that died holding one
    [lost] = gone.read([keys.ready(JOB)], count=1, block_ms=50)
    taken = []
    for _ in range(8):  # 8 reclaim passes, each past claim_idle: far beyond max_deliveries
        time.sleep(0.03)
        holder._last_claim = 0
        taken += holder.read([keys.ready(JOB)], count=2, block_ms=1)
    assert [e.id for e in taken] == [lost.id]  # the dead consumer's entry, once; never our own again
    assert r.xlen(keys.dead_letter(JOB)) == 0 and read_ledger(r, JOB).get("dead", 0) == 0
    mine = r.xpending_range(keys.ready(JOB), keys.GROUP_TRAINER, "-", "+", 10, consumername="trainer")
    assert {p["message_id"].decode(): p["times_delivered"] for p in mine if p["message_id"].decode() != lost.id} == {
        e.id: 1 for e in held
    }
    assert holder.ack([*held, lost], {JOB: {"trained": 3}}) == 3 and audit(r, JOB).balanced
