"""Connecting to Redis, and the start-up checks that protect the run's data.

An eviction policy other than `noeviction` can silently drop a whole stream under
memory pressure, so we refuse to run on one. AOF off means a Redis crash loses the
last moments of the run: allowed (CI, a throwaway laptop) but logged loudly.
"""

from __future__ import annotations

import redis


class RedisPolicyError(RuntimeError):
    """Redis is configured in a way that can lose data; the message says how to fix it."""


def connect(url: str) -> redis.Redis:
    """A client with timeouts, so a dead server surfaces as an error instead of a hang."""
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=10.0,
        socket_connect_timeout=3.0,
        health_check_interval=15,
        retry_on_timeout=False,
    )


def check_server(r: redis.Redis) -> list[str]:
    """Raise RedisPolicyError on an eviction policy; return warnings (e.g. AOF off)."""
    warnings: list[str] = []
    try:
        policy = _config(r, "maxmemory-policy")
        aof = _config(r, "appendonly")
    except redis.ResponseError:  # managed Redis often forbids CONFIG: say so, go on
        return ["cannot read Redis CONFIG (managed server?): make sure maxmemory-policy is noeviction"]
    if policy and policy != "noeviction":
        raise RedisPolicyError(
            f"Redis maxmemory-policy is {policy!r}: it may evict stream entries and lose data. "
            "Set `maxmemory-policy noeviction` (redis.conf or CONFIG SET) and restart burstrl."
        )
    if aof != "yes":
        warnings.append("Redis AOF is off: a Redis crash loses recent stream entries (appendonly yes)")
    return warnings


def _config(r: redis.Redis, name: str) -> str:
    # redis-py returns str or bytes keys depending on version and decode_responses.
    got = {(k.decode() if isinstance(k, bytes) else k): v for k, v in r.config_get(name).items()}
    v = got.get(name, "")
    return v.decode() if isinstance(v, bytes) else str(v)
