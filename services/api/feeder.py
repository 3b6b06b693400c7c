"""The prompt feeder: keeps each running job's prompt stream topped up, never more.

In flight = fed - (trained + dropped + dead-lettered). Without a backlog the feeder keeps that
at or below (max_staleness + 1) x batch_size (docs/architecture.md, invariant 4): when the
trainer is away, rollout drains the window and then idles instead of making samples that
would only be dropped as stale. A job with a backlog may have backlog.max_groups more in
flight, up to backlog.max_bytes of stored segments, and no more in Redis than its hot limit
(shared/backlog.py, `feed_room`: the one rule, which rollout's /readyz also reports).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

import redis

from shared import keys
from shared.backlog import budget_problem, feed_room
from shared.bus import feed, trim_job
from shared.domain.tasks import TaskItem, task_for_job
from shared.job import JobRecord, JobState, UnreadableJob, load_job, set_state, update_job
from shared.ledger import UnknownJob
from shared.metrics import read_evals, read_ledger
from shared.policy import read_pointer
from shared.schema import PromptMsg, encode
from shared.slots import read_streams
from shared.store import ObjectStore

log = logging.getLogger(__name__)
TRIM_EVERY_S = 5.0  # retention pass per job; trimming is cheap but need not run every tick


class Feeder:
    def __init__(self, r: redis.Redis, store: ObjectStore | None = None) -> None:
        """`store`: where the jobs' backlogs spill, to check that it can hold their budgets."""
        self.r = r
        self.store = store
        self._budget_ok: set[str] = set()  # jobs whose backlog budget the store was checked to hold
        self._iters: dict[str, tuple[int, Iterator[TaskItem]]] = {}
        self._trimmed_at: dict[str, float] = {}
        self._cursors: dict[bytes, bytes] = {}  # metrics stream -> last id seen (for `wait`)
        self._active: list[str] = []  # the active jobs as of the last tick
        self._unreadable: set[str] = set()  # jobs whose record could not be read (said once each)

    def _items(self, rec: JobRecord, fed: int) -> Iterator[TaskItem]:
        pos, it = self._iters.get(rec.id, (-1, iter(())))
        if pos != fed:  # first time, or after an api restart: replay to the durable position
            it = itertools.islice(task_for_job(rec.spec).train_items(rec.spec.seed), fed, None)
        return it

    def tick(self) -> int:
        """Feed every running job up to its window; returns prompts fed."""
        total = 0
        self._active = sorted(j.decode() for j in self.r.smembers(keys.active_jobs()))
        for job_id in self._active:
            try:
                total += self._feed(job_id)
                self._trim(job_id)
            except redis.ConnectionError:
                raise  # the whole api is not ready: let ServiceRuntime.survive say so
            except UnreadableJob as e:
                # Not fed (no stage serves it); said once, not every tick. GET /v1/dashboard lists
                # it under `unreadable`, and DELETE /v1/jobs/{id} removes it.
                if job_id not in self._unreadable:
                    self._unreadable.add(job_id)
                    log.error("%s; not fed", e)
                self._iters.pop(job_id, None)
            except Exception:
                # One broken job (say, a task whose prompt source raises) must not starve
                # every job after it in the set.
                log.exception("feeding job %s failed; other jobs carry on", job_id)
                self._iters.pop(job_id, None)
        return total

    def wait(self, timeout_s: float) -> None:
        """Sleep until a running job records a metrics point, or `timeout_s`.

        Room in a job's window opens when the trainer acknowledges a step, and the trainer
        records its point right after that ack: waking on it refills the window at once
        instead of up to one polling interval later. On a fast pipeline that interval was
        a visible bubble per step (rollout waits for prompts while the trainer waits for
        rollouts). Points of other stages wake it too; a tick is a few cheap reads.
        """
        streams = [keys.metrics(j).encode() for j in self._active]  # the jobs the last tick saw
        if not streams:
            time.sleep(timeout_s)
            return
        ids = {s: self._cursors.get(s, b"$") for s in streams}
        got = read_streams(self.r, ids, count=100, block_ms=max(1, int(timeout_s * 1000)))
        for stream, entries in got or []:
            self._cursors[stream] = entries[-1][0]
        for s in list(self._cursors):
            if s not in ids:  # jobs no longer active
                del self._cursors[s]

    def _feed(self, job_id: str) -> int:
        rec = load_job(self.r, job_id)
        if rec is None:
            return 0
        if rec.state == JobState.completed:
            self._maybe_retire(rec)
            return 0
        if rec.state != JobState.running:
            return 0
        if rec.spec.agent.enabled or rec.spec.tinker:  # groups come from agents (docs/agents.md); none for Tinker
            return 0
        if not self._budget_holds(rec):
            return 0
        led = read_ledger(self.r, rec.id)
        room, _ = feed_room(self.r, rec, led)
        if room <= 0:
            return 0
        fed = led.get("fed", 0)
        it = self._items(rec, fed)
        payloads = [
            encode(
                PromptMsg(
                    job_id=rec.id,
                    group_id=f"{rec.id}:g{fed + n}",
                    item_id=item.item_id,
                    prompt=item.prompt,
                    fields=item.fields,
                    fed_at=time.time(),
                )
            )
            for n, item in enumerate(itertools.islice(it, room))
        ]
        if not payloads:
            return 0  # a finite prompt source ran out
        # The prompts and the ledger's `fed` commit together, and only from the `fed` read above,
        # so the durable position always equals the prompts in the stream, and a Redis flushed
        # since that read gets nothing of the job back from a feeder (the api recovers it).
        try:
            n = feed(self.r, rec.id, fed, payloads)
        except UnknownJob as e:
            log.warning("job %s: not fed: %s", rec.id, e)
            n = 0
        if n == 0:  # Redis lost the job, or another api replica fed this position first
            self._iters.pop(rec.id, None)  # the position is unknown: read it again next tick
            return 0
        self._iters[rec.id] = (fed + n, it)
        return n

    def _budget_holds(self, rec: JobRecord) -> bool:
        """A backlog budget the store cannot hold fails the job at once, with the reason naming
        the field: never a backlog that silently stops short of what the job asked for."""
        if rec.id in self._budget_ok or self.store is None or not rec.spec.backlog.enabled:
            return True
        if why := budget_problem(rec.spec, self.store):
            log.error("job %s: %s; failing it", rec.id, why)
            set_state(self.r, rec.id, JobState.failed, only_from={JobState.running}, error=f"api: {why}")
            return False
        self._budget_ok.add(rec.id)
        return True

    def _trim(self, job_id: str) -> None:
        """Retention: drop stream entries every stage has acknowledged (never pending ones)."""
        now = time.monotonic()
        if now - self._trimmed_at.get(job_id, 0.0) < TRIM_EVERY_S:
            return
        self._trimmed_at[job_id] = now
        if removed := trim_job(self.r, job_id):
            log.debug("job %s: trimmed %d acknowledged entries", job_id, removed)

    def _maybe_retire(self, rec: JobRecord) -> None:
        """A completed job leaves the active set once its final version is evaluated."""
        final = read_pointer(self.r, rec.id)
        evaluated = {e["version"] for e in read_evals(self.r, rec.id)}
        if final in evaluated or rec.spec.eval_size == 0 or time.time() - rec.updated_at > 600:
            self.r.srem(keys.active_jobs(), rec.id)
            update_job(self.r, rec.id, lambda _: True)  # updated_at: when it retired
