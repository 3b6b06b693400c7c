"""A deposed trainer that races the new holder to publish the same version (real Redis, a file
store): it must stop as deposed (LeaseLost), never crash on the store's "already exists".

The race the SIGSTOP takeover test hit: trainer A looked, saw no v1 manifest, and froze; B took
the lease and published v1; A thawed and wrote. A then died with StoreError instead of taking
the "stopping without writing anything more" path."""

from __future__ import annotations

import pytest

from services.trainer.publishing import Publisher
from shared import keys
from shared.lease import Lease, LeaseLost
from shared.policy import read_manifest
from shared.store import FileStore

JOB = "race-1"
FILES = {"adapter_model.safetensors": b"weights"}
PROBE = {"token_ids": [1, 2, 3], "logprobs": [-1.0, -2.0]}


def _publisher(r, store, lease: Lease) -> Publisher:  # noqa: ANN001
    def assert_lease() -> None:  # as TrainerLoop._assert_lease does
        if not lease.held():
            raise LeaseLost(f"job {JOB}: lease lost (another trainer holds it now)")

    return Publisher(store, r, JOB, "base", lease=lease, assert_lease=assert_lease, probe_tolerance=1e-3)


def test_a_deposed_trainer_that_lost_the_race_to_publish_stops_as_deposed(r, tmp_path):
    store = FileStore(tmp_path / "store")
    a, b = Lease(r, JOB, "trainer-a", 5), Lease(r, JOB, "trainer-b", 5)
    assert a.acquire()
    pub_a = _publisher(r, store, a)
    # A looks for v1 before it writes (Publisher.publish's first check) and finds none...
    looked = pub_a.exists(1)
    assert not looked
    # ...then freezes past its TTL: B takes the lease and publishes v1.
    r.delete(keys.trainer_lease(JOB))
    assert b.acquire() and b.epoch > a.epoch
    _publisher(r, store, b).publish(1, FILES, PROBE)
    # A thaws where it had looked: the next write it makes must be refused as deposed.
    pub_a.exists = lambda v: looked  # type: ignore[method-assign]  (what A saw before it froze)
    with pytest.raises(LeaseLost):
        pub_a.publish(1, {"adapter_model.safetensors": b"other weights"}, PROBE)
    assert read_manifest(store, JOB, 1).epoch == b.epoch  # B's version stands
