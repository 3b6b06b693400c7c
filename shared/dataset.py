"""Which Redis dataset a service works on: losing Redis's data is loud, never silent.

docs/architecture.md, invariant 11. A Redis restarted without its data (no AOF, an emptied
volume, a failover to an empty replica) looks healthy: every PING answers, so every service
would report `redis: ok` while jobs, ledgers and pending entries are gone. So the dataset
carries an identity, a random id in one key (`keys.dataset()`), created by the first service
that starts on an empty Redis. Each service remembers the id it started with and checks it
on every heartbeat: a changed or missing id makes the service not ready, with the reason,
and its worker pauses (`ServiceRuntime.survive`), until an operator recovers.

Recovery (`POST /v1/jobs/recover`, `burstrl recover`) re-registers the jobs the store still
holds and writes a new id that `supersedes` the ids the services remember (their heartbeats
say which): those services adopt it and carry on; any other stays not ready.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

import redis

from shared import keys

log = logging.getLogger(__name__)


def new_dataset(r: redis.Redis, *, supersedes: list[str] | None = None, force: bool = False) -> str:
    """Write a new dataset id (only if none exists, unless `force`); returns the id now stored."""
    value = {"id": secrets.token_hex(8), "created_at": time.time(), "supersedes": sorted(set(supersedes or []))}
    r.set(keys.dataset(), json.dumps(value), nx=not force)
    cur = read_dataset(r)
    return cur["id"] if cur else value["id"]


def read_dataset(r: redis.Redis) -> dict | None:
    raw = r.get(keys.dataset())
    if raw is None:
        return None
    try:
        value = json.loads(raw)
        return value if isinstance(value, dict) and isinstance(value.get("id"), str) else None
    except ValueError:
        return None


class DatasetGuard:
    """The dataset id this service started on, and whether Redis still holds that dataset."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.id = ""

    def attach(self) -> str:
        """At start: remember the current id (creating one on an empty Redis)."""
        self.id = new_dataset(self.r)
        return self.id

    def check(self) -> str:
        """ "" while Redis holds our dataset; else why not (the /readyz reason)."""
        if not self.id:
            return ""
        cur = read_dataset(self.r)
        if cur is not None and cur["id"] == self.id:
            return ""
        if cur is not None and self.id in cur.get("supersedes", []):
            log.warning("redis: dataset %s recovered as %s; carrying on with it", self.id, cur["id"])
            self.id = cur["id"]
            return ""
        now = "it holds no dataset id" if cur is None else f"it holds dataset {cur['id']}"
        return (
            f"Redis lost its data: this service started on dataset {self.id}, {now} (restarted without its AOF, "
            "or replaced). Jobs, ledgers and queues are gone from Redis; the object store still has the jobs' "
            "checkpoints and versions: see `burstrl jobs --orphaned`, then `burstrl recover` (or restore Redis "
            "from its AOF and restart this service)"
        )
