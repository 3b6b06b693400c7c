"""Connecting to Redis, and the start-up checks that protect the run's data.

An eviction policy other than `noeviction` can silently drop a whole stream under
memory pressure, so we refuse to run on one. AOF off means a Redis crash loses the
last moments of the run: allowed (CI, a throwaway laptop) but logged loudly.
A wrong password or a certificate we do not trust is a refusal too: waiting for Redis
is right while it restarts, but no amount of waiting fixes those (a burst trainer
would sit not-ready for its whole rental), so `refusal` tells them apart.

One Redis or a Redis Cluster, said by REDIS_URL's scheme: `redis://` and `rediss://` dial one
server, `redis+cluster://` and `rediss+cluster://` a cluster (any of its nodes), through
redis-py's own cluster client (it follows the slots, MOVED and failovers). The deployment says
which it expects, and `check_server` refuses the other at start-up: a single-Redis client on a
cluster node works only for the keys on that node's slots, and fails on the rest with MOVED.
"""

from __future__ import annotations

import ssl
from typing import Any

import redis
import redis.cluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# A client of either kind: everything burstrl sends works on both (shared/keys.py's hash tags).
Client = redis.Redis | redis.cluster.RedisCluster


def cluster_url(url: str) -> str | None:
    """The redis-py URL of a cluster REDIS_URL (the scheme without "+cluster"); None: one Redis."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    return f"{plain}://{rest}" if plain else None


def is_cluster(r: Any) -> bool:
    return isinstance(r, redis.cluster.RedisCluster)


class RedisPolicyError(RuntimeError):
    """Redis is configured in a way that can lose data; the message says how to fix it."""


def refusal(e: BaseException) -> str | None:
    """Why connecting can never succeed as configured (credentials, TLS trust), with the fix; None
    for errors worth waiting out (Redis down, restarting, loading its AOF)."""
    if isinstance(e, redis.AuthenticationError):  # WRONGPASS, NOAUTH, a password the server lacks
        return f"Redis refused the credentials in REDIS_URL ({e}): use the server's requirepass"
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return (
                f"Redis's TLS certificate is not trusted ({cause.verify_message or cause}): give the CA that "
                "signed it (rediss://...?ssl_ca_certs=/path/ca.crt, or BURST_CA_CERT for the burst recipe) "
                "and dial the name the certificate carries"
            )
        cause = cause.__cause__ or cause.__context__
    return None


# Every client's options: bytes replies, and timeouts so a dead server is an error, not a hang.
_OPTIONS: dict[str, Any] = {
    "decode_responses": False,
    "socket_timeout": 10.0,
    "socket_connect_timeout": 3.0,
    "health_check_interval": 15,
    "retry_on_timeout": False,
}


def connect(url: str) -> redis.Redis:
    """A client with timeouts, so a dead server surfaces as an error instead of a hang.

    A cluster URL gives redis-py's RedisCluster (typed as redis.Redis here: the commands burstrl
    sends are the same). Unlike the single client it dials at once, to learn the slots: an
    unreachable cluster raises redis.ConnectionError, and a URL naming a cluster whose node is a
    single Redis raises RedisPolicyError."""
    cluster = cluster_url(url)
    if cluster is None:
        return redis.Redis.from_url(url, **_OPTIONS)
    try:
        return redis.cluster.RedisCluster.from_url(cluster, **_OPTIONS)  # type: ignore[return-value]
    except redis.RedisClusterException as e:
        if "cluster mode is not enabled" in str(e).lower() or "cluster_enabled" in str(e).lower():
            raise RedisPolicyError(_mismatch(expects_cluster=True)) from None
        raise redis.ConnectionError(f"Redis Cluster unreachable: {e}") from e


def _mismatch(*, expects_cluster: bool) -> str:
    if expects_cluster:
        return (
            "REDIS_URL names a Redis Cluster (redis+cluster:// or rediss+cluster://), but the server it names is "
            "a single Redis (cluster_enabled:0): use redis:// (or rediss://) for one Redis, or point REDIS_URL at "
            "a node of the cluster"
        )
    return (
        "REDIS_URL names one Redis (redis:// or rediss://), but the server it names is a Redis Cluster node "
        "(cluster_enabled:1): a single-Redis client reaches only that node's slots. Use redis+cluster:// "
        "(or rediss+cluster://) with the same host and port"
    )


def connect_async(url: str, *, longest_block_s: float) -> redis.asyncio.Redis:
    """An asyncio client for long polls (the Tinker API's retrieve_future): the same timeouts,
    the read timeout above the longest blocking command it sends."""
    import redis.asyncio
    import redis.asyncio.cluster

    options = {**_OPTIONS, "socket_timeout": longest_block_s + 10.0}
    cluster = cluster_url(url)
    if cluster is not None:  # dials on its first command (the sync client checked the mode at start)
        options.pop("retry_on_timeout")  # not a setting of the asyncio cluster client (it retries by `retry`)
        return redis.asyncio.cluster.RedisCluster.from_url(cluster, **options)  # type: ignore[return-value]
    return redis.asyncio.Redis.from_url(url, **options)


def check_server(r: redis.Redis) -> list[str]:
    """Raise RedisPolicyError on an eviction policy, or on a server of the other kind than the
    client (one Redis vs a cluster: REDIS_URL's scheme); return warnings (e.g. AOF off)."""
    info = r.info("cluster")
    enabled = str(info.get("cluster_enabled", 0)) == "1"
    if enabled != is_cluster(r):
        raise RedisPolicyError(_mismatch(expects_cluster=is_cluster(r)))
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
