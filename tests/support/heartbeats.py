"""A service's heartbeat written straight to Redis, as a replica that is not running would
have written it: how the api, dashboard and retention tests stand in for rollout replicas."""

from __future__ import annotations

import time
from typing import Any

import redis

from shared import keys
from shared.schema import Heartbeat, encode_heartbeat


def fake_heartbeat(r: redis.Redis, replica: str, *, role: str = "rollout", ttl_s: int = 60, **gauges: Any) -> None:
    """A ready `role` replica named `replica`, beating now, with `gauges` (Heartbeat's optional
    fields: policy_versions, idle_frac, rollout_model, ...); the key expires after `ttl_s` s like a
    real one's, so a test's fake replica does not outlive the test's Redis data."""
    beat = Heartbeat(role=role, replica=replica, host="box", port=1, version="0", ready=True, at=time.time(), **gauges)
    r.set(keys.service(role, replica), encode_heartbeat(beat), ex=ttl_s)
