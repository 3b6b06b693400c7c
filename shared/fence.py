"""The store's side of the trainer fence: which version and checkpoint writes count.

docs/architecture.md, invariant 10. Redis orders the trainers of a job by their lease epoch
(shared/lease.py), but the object store has no compare-and-set, so a trainer that stalled
past its lease (a GC pause, a frozen VM, a slow upload) can still land a write after another
trainer took over. Such a write must never be used. So:

- every version and checkpoint manifest carries the epoch of the lease its writer held;
- a trainer that takes a job over writes, before anything else, one takeover record
  `jobs/{job}/trainer/fence/e{epoch}.json` naming the newest version and checkpoint it
  found in the store at that moment (one object per takeover: no writer can overwrite
  another's record, stalled or not);
- a reader accepts a manifest of epoch e numbered n only if every takeover after e found
  n already there (n <= that takeover's newest). Anything a deposed trainer wrote after it
  was replaced is numbered above what its successor found, so it is refused, and its
  successor publishes that number again itself.

Manifests from before fencing carry epoch 0 and obey the same rule.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

from shared.store import ObjectStore, StoreError

Kind = Literal["version", "checkpoint"]


def fence_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/trainer/fence/"


def takeover_key(job_id: str, epoch: int) -> str:
    return f"{fence_prefix(job_id)}e{epoch:012d}.json"


@dataclass(frozen=True)
class Takeover:
    epoch: int
    owner: str
    version: int  # newest version with a manifest when the lease was taken (-1: none)
    checkpoint: int  # newest checkpoint step with a manifest then (-1: none)
    at: float


def record_takeover(store: ObjectStore, job_id: str, epoch: int, owner: str, *, version: int, checkpoint: int) -> None:
    """Write this takeover's record; must come before the new holder writes anything else."""
    t = {"epoch": epoch, "owner": owner, "version": version, "checkpoint": checkpoint, "at": time.time()}
    store.put(takeover_key(job_id, epoch), json.dumps(t).encode())


def _epochs(store: ObjectStore, job_id: str) -> dict[int, str]:
    out = {}
    for key in store.list(fence_prefix(job_id)):
        name = key.rsplit("/", 1)[-1]
        if name.startswith("e") and name.endswith(".json") and name[1:-5].isdigit():
            out[int(name[1:-5])] = key
    return out


def max_epoch(store: ObjectStore, job_id: str) -> int:
    """The highest lease epoch any trainer of the job recorded (0: none)."""
    return max(_epochs(store, job_id), default=0)


def takeovers_after(store: ObjectStore, job_id: str, epoch: int) -> list[Takeover]:
    """Takeover records of epochs above `epoch`, oldest first."""
    out = []
    for e, key in sorted(_epochs(store, job_id).items()):
        if e <= epoch:
            continue
        try:
            raw = json.loads(store.get(key))
            out.append(
                Takeover(
                    int(raw["epoch"]), str(raw["owner"]), int(raw["version"]), int(raw["checkpoint"]), float(raw["at"])
                )
            )
        except (StoreError, ValueError, KeyError, TypeError) as e:
            # A takeover record we cannot read could hide a refusal: refuse to guess.
            raise StoreError(f"fence record {key} unreadable: {e}") from e
    return sorted(out, key=lambda t: t.epoch)


def refusal(store: ObjectStore, job_id: str, kind: Kind, number: int, epoch: int) -> str:
    """Why a manifest (version or checkpoint `number`, written under lease `epoch`) must not be
    used, or "" when it may. Costs one LIST (plus a GET per later takeover)."""
    for t in takeovers_after(store, job_id, epoch):
        newest = t.version if kind == "version" else t.checkpoint
        if number > newest:
            return (
                f"{kind} {number} was written under lease epoch {epoch} after trainer {t.owner} took the job over "
                f"with epoch {t.epoch} (it found {kind}s up to {newest}): a deposed trainer's write"
            )
    return ""
