"""The trainer lease: one trainer per job, owned by a token, fenced by an epoch.

docs/architecture.md, invariant 10. The lease is a Redis key holding "{token} {epoch}":
- taken with SET NX; every take bumps the job's epoch counter, in the same script, so each
  holder has an epoch larger than every holder before it;
- renewed by compare-and-set (only the token that holds it can extend it) and released by
  compare-and-delete (a trainer that lost it can never delete the winner's lease);
- Redis writes that only the holder may make (acknowledging trained groups, moving the
  policy pointer) check the token inside their own script (`FENCE_CHECK`), so a deposed
  trainer's write fails atomically instead of racing the winner;
- object-store writes carry the epoch in their manifest, and the store keeps the history of
  takeovers (`jobs/{job}/trainer/fence.json`): a version or checkpoint a deposed holder
  wrote after it was replaced is refused by every reader (`fenced_out`). See
  `services/trainer/fencing.py` for the writer's side.

A `LeaseKeeper` thread renews the lease every ttl/3 while the trainer steps or uploads, so
a step or checkpoint upload longer than the TTL no longer loses it (a 0.5B model on CPU took
34 s a step against a 30 s TTL); the TTL then only bounds how long a dead trainer's job
waits for another.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass

import redis

from shared import keys

log = logging.getLogger(__name__)

# KEYS: lease, epoch counter. ARGV: token, ttl ms, floor. Returns the epoch if we hold the
# lease now (taken now: a new epoch above `floor`; already ours: its epoch), else nil.
ACQUIRE_LUA = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[3]) then
    redis.call('SET', KEYS[2], ARGV[3])
  end
  local epoch = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. epoch, 'PX', ARGV[2])
  return epoch
end
local token, epoch = string.match(cur, '^(%S+) (%d+)$')
if token == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(epoch)
end
return false
"""

# KEYS: lease. ARGV: "{token} {epoch}", ttl ms. 1 if extended, 0 if the lease is not ours.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: "{token} {epoch}". 1 if deleted, 0 if it was not ours (left alone).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# The guard other scripts start with to be fenced: KEYS[1] the lease, ARGV[1] "{token} {epoch}".
# (A script that moves state only the holder may move returns -1 when the caller lost the lease.)
FENCE_CHECK = "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end\n"


class LeaseLost(RuntimeError):
    """This trainer no longer holds the job's lease: another one may be training it."""


@dataclass(frozen=True)
class Fence:
    """What a fenced write carries: the lease key, the holder's value in it, and the epoch."""

    key: str
    value: str
    epoch: int


class Lease:
    def __init__(self, r: redis.Redis, job_id: str, owner: str, ttl_s: float) -> None:
        self.r, self.job_id, self.ttl_ms = r, job_id, max(1000, int(ttl_s * 1000))
        # A fresh token per process: a restarted trainer with the same replica name is another
        # holder, and must not renew (or release) the lease its earlier self held.
        self.token = f"{owner}/{secrets.token_hex(4)}".replace(" ", "_")
        self.key = keys.trainer_lease(job_id)
        self.epoch = 0
        self._acquire = r.register_script(ACQUIRE_LUA)
        self._renew = r.register_script(RENEW_LUA)
        self._release = r.register_script(RELEASE_LUA)

    @property
    def value(self) -> str:
        return f"{self.token} {self.epoch}"

    @property
    def fence(self) -> Fence:
        if not self.epoch:
            raise LeaseLost(f"job {self.job_id}: lease not held")
        return Fence(self.key, self.value, self.epoch)

    def acquire(self, *, floor: int = 0) -> bool:
        """Take the lease if it is free (or already ours). Sets `epoch` on success.

        `floor`: the highest epoch any holder is known to have used (the store's takeover
        records): a Redis that lost its counter must not hand out an epoch again."""
        got = self._acquire(
            keys=[self.key, keys.trainer_epoch(self.job_id)], args=[self.token, self.ttl_ms, int(floor)]
        )
        if got is None:
            return False
        self.epoch = int(got)
        return True

    def renew(self) -> bool:
        """Extend the lease if we still hold it (compare-and-set)."""
        return bool(self.epoch) and bool(self._renew(keys=[self.key], args=[self.value, self.ttl_ms]))

    def held(self) -> bool:
        """Whether the lease is ours right now (one GET)."""
        cur = self.r.get(self.key)
        return bool(self.epoch) and cur is not None and cur.decode() == self.value

    def lost_reason(self) -> str:
        """Why this holder no longer holds the lease, as far as Redis tells: another holder's
        token in it, or no lease at all (it expired, or Redis lost its data)."""
        cur = self.r.get(self.key)
        if cur is None:
            return "its lease is gone from Redis (it expired, or Redis lost its data: see the redis check)"
        token, _, epoch = cur.decode(errors="replace").partition(" ")
        return f"another trainer holds it now ({token}, epoch {epoch})"

    def release(self) -> bool:
        """Delete the lease only if it is still ours (compare-and-delete)."""
        if not self.epoch:
            return False
        try:
            return bool(self._release(keys=[self.key], args=[self.value]))
        finally:
            self.epoch = 0


class LeaseKeeper:
    """Renews a lease from a thread every ttl/3 until stopped; sets `lost` when renewal fails."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.lost = threading.Event()
        self.reason = ""  # why it was lost, once `lost` is set
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.job_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        period = self.lease.ttl_ms / 3000
        while not self._stop.wait(period):
            try:
                if not self.lease.renew():
                    self.reason = self.lease.lost_reason()
                    log.error("job %s: lease lost: %s", self.lease.job_id, self.reason)
                    self.lost.set()
                    return
            except redis.RedisError as e:  # a blip: the next renewal may still make it in time
                log.warning("job %s: could not renew the lease: %s", self.lease.job_id, e)

    def check(self) -> None:
        """Raise LeaseLost if the keeper found the lease gone."""
        if self.lost.is_set():
            raise LeaseLost(f"job {self.lease.job_id}: lease lost: {self.reason}")
