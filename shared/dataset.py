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

On a Redis Cluster one key cannot speak for every master, and a failover loses data without
emptying anything: replication is asynchronous, so a replica promoted in place of a dead
master may lack its last writes, while every key the service reads is still there. So on a
cluster the guard also remembers, per slot range, the master that served it and a marker key
(holding the dataset id) placed on that range's slots; a range now served by another master (a
replica promoted, or a master added), or whose marker is gone (a master back without its data),
is reported exactly like a lost dataset. Recovery's new id is adopted with the cluster as it
is then (the ranges and markers remembered again).
"""

from __future__ import annotations

import json
import logging
import secrets
import time

import redis
from redis.crc import key_slot

from shared import keys
from shared.redis_conn import is_cluster

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


Range = tuple[int, int]  # a slot range, both ends included


def cluster_masters(r: redis.Redis) -> dict[Range, str]:
    """Each slot range of a cluster with the node id of the master serving it (CLUSTER NODES, as
    the node asked sees it)."""
    out: dict[Range, str] = {}
    for node in r.cluster_nodes().values():  # type: ignore[attr-defined]
        flags = node["flags"]
        if "master" not in flags or "fail" in flags:
            continue
        for rng in node["slots"]:
            lo, hi = int(rng[0]), int(rng[-1])
            out[(lo, hi)] = node["node_id"]
    return out


def marker_key(rng: Range) -> str:
    """A key whose slot is in `rng`: the dataset marker of that range (its hash tag is found by
    counting up, once per range; a few thousand tries at most for a range of ~5,000 slots)."""
    for i in range(1_000_000):
        tag = f"{keys.PREFIX}:dataset-{i}"
        if rng[0] <= key_slot(tag.encode()) <= rng[1]:
            return f"{{{tag}}}:dataset"
    raise ValueError(f"no dataset marker tag for slots {rng[0]}-{rng[1]}")


class DatasetGuard:
    """The dataset id this service started on, and whether Redis still holds that dataset."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.id = ""
        self.masters: dict[Range, str] = {}  # on a cluster: who served each slot range at attach
        self.markers: dict[Range, str] = {}  # and the range's marker key

    def attach(self) -> str:
        """At start: remember the current id (creating one on an empty Redis)."""
        self.id = new_dataset(self.r)
        self._remember_cluster()
        return self.id

    def _remember_cluster(self, *, overwrite: bool = False) -> None:
        """On a cluster: remember who serves each slot range, and mark each range with the id
        (`overwrite`: every range; else where no marker is, or where it holds an id the dataset
        superseded: a recovery no running service adopted; a marker of any other dataset stays,
        and `check` says so)."""
        if not is_cluster(self.r):
            return
        cur = read_dataset(self.r) or {}
        self.masters = cluster_masters(self.r)
        self.markers = {rng: marker_key(rng) for rng in self.masters}
        for key in self.markers.values():
            held = None if overwrite else self.r.get(key)
            if held is None or held.decode() in cur.get("supersedes", []):
                self.r.set(key, self.id)

    def _adopt(self, new_id: str) -> None:
        """Recovery superseded our id: carry on with `new_id` and the cluster as it is now."""
        self.id = new_id
        self._remember_cluster(overwrite=True)

    def _cluster_loss(self) -> str:
        """ "" while every slot range is served by the master that served it at attach and still
        holds its marker; else what changed."""
        if not self.masters:
            return ""
        now = cluster_masters(self.r)
        for rng, node in sorted(self.masters.items()):
            served = [n for (lo, hi), n in now.items() if lo <= rng[1] and hi >= rng[0]]
            moved = sorted(set(served) - set(self.masters.values()))
            if moved:
                return (
                    f"slots {rng[0]}-{rng[1]} were served by master {node} and are now served by {', '.join(moved)} "
                    "(a failover promoted a replica, or a master was added): replication is asynchronous, so the "
                    "writes the old master had not yet passed on are gone"
                )
        for rng, key in sorted(self.markers.items()):
            got = self.r.get(key)
            if got is None or got.decode() != self.id:
                held = "is missing" if got is None else f"holds dataset {got.decode()}"
                return f"the dataset marker of slots {rng[0]}-{rng[1]} ({key}) {held}: that master came back without its data"
        return ""

    def check(self) -> str:
        """ "" while Redis holds our dataset; else why not (the /readyz reason)."""
        if not self.id:
            return ""
        cur = read_dataset(self.r)
        if cur is not None and cur["id"] != self.id and self.id in cur.get("supersedes", []):
            log.warning("redis: dataset %s recovered as %s; carrying on with it", self.id, cur["id"])
            self._adopt(cur["id"])
            return ""
        if cur is not None and cur["id"] == self.id:
            lost = self._cluster_loss()
            if not lost:
                return ""
            return (
                f"Redis lost data: this service started on dataset {self.id}, and on the cluster since {lost}. "
                f"{_RECOVER}"
            )
        now = "it holds no dataset id" if cur is None else f"it holds dataset {cur['id']}"
        return (
            f"Redis lost its data: this service started on dataset {self.id}, {now} (restarted without its AOF, "
            f"or replaced). Jobs, ledgers and queues are gone from Redis; {_RECOVER}"
        )


_RECOVER = (
    "the object store still has the jobs' checkpoints and versions: see `burstrl jobs --orphaned`, then "
    "`burstrl recover` (or restore Redis from its AOF and restart this service)"
)
