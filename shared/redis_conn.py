"""Connecting to Redis, and the start-up checks that protect the run's data.

An eviction policy other than `noeviction` can silently drop a whole stream under
memory pressure, so we refuse to run on one. AOF off means a Redis crash loses the
last moments of the run: allowed (CI, a throwaway laptop) but logged loudly.
A wrong password or a certificate we do not trust is a refusal too: waiting for Redis
is right while it restarts, but no amount of waiting fixes those (a burst trainer
would sit not-ready for its whole rental), so `refusal` tells them apart.
"""

from __future__ import annotations

import ssl

import redis


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


def connect_async(url: str, *, longest_block_s: float) -> redis.asyncio.Redis:
    """An asyncio client for long polls (the Tinker API's retrieve_future): the same timeouts,
    the read timeout above the longest blocking command it sends."""
    import redis.asyncio

    return redis.asyncio.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=longest_block_s + 10.0,
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
