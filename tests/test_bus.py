"""The bus against a real redis-server."""

import pytest

from shared import keys
from shared.bus import FIELD, Bus
from shared.metrics import read_ledger
from shared.redis_conn import RedisPolicyError, check_server
from shared.schema import decode_dead

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
    bus.forward(entries, [(keys.rollouts(JOB), b"g")] * 3, {JOB: {"produced": 3}})
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
