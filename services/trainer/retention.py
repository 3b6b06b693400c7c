"""Which policy versions stay in the store: the last N, every Kth, the evaluated best, and any
version still in use. Every version is a full adapter (35 MB at rank 16 for 0.5B), so a
1000-step job that kept them all would hold ~35 GB.

In use, never deleted:
- the newest versions (the pointer and what rollout may still be adopting);
- a version a rollout replica serves (its heartbeat says which; a replica that restarts
  reloads its current version from the store);
- a version at a checkpoint's step: a trainer resuming from that checkpoint announces it
  again, and rollout must be able to fetch it;
- the best evaluated version (what a user will want to keep and deploy).
A version is deleted manifest first, so it stops existing before any file goes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import redis

from shared import keys
from shared.folders import MANIFEST
from shared.metrics import read_evals
from shared.policy import version_prefix
from shared.schema import decode_heartbeat
from shared.store import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    keep_last: int  # the newest N versions (0: keep every version: no pruning)
    keep_every: int  # and every Kth (v % K == 0; 0: none)


def versions_to_delete(versions: list[int], policy: Retention, *, in_use: set[int], best: int | None) -> list[int]:
    """The versions `policy` lets go, ascending. Version 0 (the base model) is never a folder.

    >>> versions_to_delete(list(range(1, 11)), Retention(3, 4), in_use={2}, best=5)
    [1, 3, 6, 7]
    """
    if policy.keep_last <= 0:
        return []
    ordered = sorted(v for v in versions if v > 0)
    keep = set(ordered[-policy.keep_last :]) | in_use
    if policy.keep_every > 0:
        keep |= {v for v in ordered if v % policy.keep_every == 0}
    if best is not None:
        keep.add(best)
    return [v for v in ordered if v not in keep]


def stored_versions(store: ObjectStore, job_id: str) -> list[int]:
    names = store.list_dirs(f"jobs/{job_id}/policy/")
    return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())


def served_versions(r: redis.Redis, job_id: str) -> set[int]:
    """Versions rollout replicas say they serve for the job (their heartbeats)."""
    out = set()
    for key in r.scan_iter(match=keys.service("rollout", "*"), count=500):
        raw = r.get(key)
        if not raw:
            continue
        try:
            v = decode_heartbeat(raw).policy_versions.get(job_id)
        except ValueError:
            continue
        if v is not None:
            out.add(int(v))
    return out


def best_evaluated(r: redis.Redis, job_id: str) -> int | None:
    evals = [e for e in read_evals(r, job_id) if isinstance(e.get("pass@1", e.get("accuracy")), int | float)]
    if not evals:
        return None
    return max(evals, key=lambda e: (e.get("pass@1", e.get("accuracy")), e["version"]))["version"]


def prune_versions(
    store: ObjectStore, r: redis.Redis, job_id: str, policy: Retention, *, checkpoint_steps: list[int]
) -> list[int]:
    """Delete the versions the policy lets go; returns them."""
    if policy.keep_last <= 0:
        return []
    gone = versions_to_delete(
        stored_versions(store, job_id),
        policy,
        in_use=served_versions(r, job_id) | set(checkpoint_steps),
        best=best_evaluated(r, job_id),
    )
    for v in gone:
        prefix = version_prefix(job_id, v)
        store.delete(f"{prefix}/{MANIFEST}")  # first: the version stops existing
        for key in store.list(prefix + "/"):
            store.delete(key)
    if gone:
        log.info("job %s: deleted %d old policy versions (%s)", job_id, len(gone), json.dumps(gone[:10]))
    return gone
