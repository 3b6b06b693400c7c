"""Jobs that cannot make progress fail with their reason, within a bound (docs/architecture.md,
invariant 11), instead of holding the trainer forever; and a trainer that waits for a batch says
for how long and what holds it up (`BatchWait`), instead of looking healthy while nothing trains.

Two ways a job gets stuck:
- **Rollout never adopts a new version** (every version refused by its probe, forged
  versions, a probe tolerance no version can pass): groups keep arriving sampled on a version
  the trainer left behind, the trainer drops each as stale, and nothing is ever trained. The
  signal is a group sampled well after the version that would have made it fresh was
  published: a backlog of old data drained after a trainer break is not that (it was
  sampled before the new versions existed), so draining it never trips this.
- **The trainer cannot load or train the job at all** (a base model it cannot load, a seed
  torch cannot take): the trainer process would crash-loop on it and never reach another
  job. Failures are counted per job in Redis (they survive the trainer's restarts); after
  `max_attempts` in a row the job is failed with the last error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from shared import keys
from shared.backlog import feed_room
from shared.job import JobRecord, JobState, load_job, set_state
from shared.metrics import read_ledger
from shared.schema import GroupMsg
from shared.service import Health

log = logging.getLogger(__name__)
PROGRESS_CHECK = "progress"  # the trainer's /readyz check (degraded while no batch forms)


class JobStuck(RuntimeError):
    """The job cannot make progress; the message says why and what to check."""


class StaleStreak:
    """Counts groups dropped as stale that rollout sampled after it should have moved on."""

    def __init__(
        self, *, max_staleness: int, limit: int, grace_s: float, published_at: Callable[[int], float | None]
    ) -> None:
        self.max_staleness, self.limit, self.grace_s = max_staleness, limit, grace_s
        self._published_at = published_at  # version -> when its manifest was written (None: unknown)
        self._known: dict[int, float] = {}
        self.streak = 0
        self.last: tuple[int, int] = (0, 0)  # (sampled on, trainer at) of the latest such group

    def published(self, version: int, at: float) -> None:
        self._known[version] = at

    def trained(self) -> None:
        self.streak = 0

    def stale(self, g: GroupMsg, trainer_version: int) -> None:
        """A group just dropped as stale: was it sampled after rollout should have adopted a
        version that would have kept it fresh?"""
        fresh_from = trainer_version - self.max_staleness  # oldest version whose samples are fresh
        at = self._known.get(fresh_from)
        if at is None:
            at = self._published_at(fresh_from)
            if at is not None:
                self._known[fresh_from] = at
        if at is not None and g.sampled_at > at + self.grace_s:
            self.streak += 1
            self.last = (g.policy_version, trainer_version)

    def stuck(self) -> str:
        if self.limit <= 0 or self.streak < self.limit:
            return ""
        sampled, at = self.last
        return (
            f"trainer: {self.streak} groups in a row arrived sampled on policy v{sampled} while the trainer is at "
            f"v{at} (max_staleness {self.max_staleness}), more than {self.grace_s:.0f}s after a fresher version "
            "was published: rollout is not adopting new versions (check rollout's /readyz and the job's "
            "rollout_version metrics for refused versions)"
        )


def note_failure(r: redis.Redis, job_id: str, error: BaseException, *, max_attempts: int) -> bool:
    """Count one failed attempt to load or train `job_id`; fail the job after `max_attempts`
    in a row. Returns True if the job was failed now."""
    n = int(r.hincrby(keys.trainer_failures(job_id), "attempts", 1))
    reason = f"{type(error).__name__}: {error}"[:2000]
    r.hset(keys.trainer_failures(job_id), mapping={"error": reason, "at": time.time()})
    if n < max_attempts:
        return False
    msg = f"trainer: gave up after {n} failed attempts to load or train the job; last error: {reason}"
    return set_state(r, job_id, JobState.failed, only_from={JobState.running}, error=msg) is not None


def clear_failures(r: redis.Redis, job_id: str) -> None:
    """A step went through: the job loads and trains, so earlier failures were transient."""
    r.delete(keys.trainer_failures(job_id))


class BatchWait:
    """Says so when no batch has formed for `report_s`: the `progress` check of the trainer's
    /readyz turns degraded (scope job: the trainer itself is fine) with what holds the batch up,
    the heartbeat carries that reason to the api, and the log says it once per wait.

    Before, a job that stopped (fed 8, trained 0 for 6.5 minutes) showed every check green."""

    def __init__(self, r: redis.Redis, rec: JobRecord, health: Health, *, report_s: float) -> None:
        self.r, self.rec, self.health, self.report_s = r, rec, health, report_s
        self.reported = False

    def check(self, waited_s: float, held: int, trained_unacked: int) -> None:
        """The loop found no full batch, `waited_s` after the last one (`held`: groups it holds)."""
        if self.report_s <= 0 or waited_s < self.report_s:
            return
        why = wait_reason(self.r, self.rec, waited_s=waited_s, held=held, trained_unacked=trained_unacked)
        if not self.reported:
            log.warning("%s", why)
            self.reported = True
        self.health.set(PROGRESS_CHECK, False, why, scope="job")

    def stepped(self) -> None:
        """A batch formed and trained."""
        self.health.set(PROGRESS_CHECK, True, scope="job")
        self.reported = False


def wait_reason(r: redis.Redis, rec: JobRecord, *, waited_s: float, held: int, trained_unacked: int) -> str:
    """What keeps the next batch of `rec` from forming, as far as Redis tells."""
    led = read_ledger(r, rec.id)
    room, full = feed_room(r, rec, led)
    upstream = led["in_flight"] - trained_unacked - held
    out = (
        f"job {rec.id}: no batch for {waited_s:.0f}s: {held} of {rec.spec.batch_size} groups held, "
        f"{trained_unacked} trained awaiting a checkpoint, {max(0, upstream)} more in flight"
    )
    cur = load_job(r, rec.id)
    if cur is not None and cur.state != JobState.running:
        out += f"; the job is {cur.state.value}: the feeder feeds it nothing"
    elif room <= 0:
        out += f"; the feeder has no room: {full}"
    if upstream > 0:
        out += " (still in rollout, reward or ref, or beyond the trainer's reach: see their /readyz)"
    elif room > 0:
        out += "; nothing is on its way: the feeder has room but fed none (a finite prompt source ran out?)"
    return out
