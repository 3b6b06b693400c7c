"""The prompt feeder: keeps each running job's prompt stream topped up, never more.

In flight = fed - (trained + dropped + dead-lettered). The feeder keeps that at or
below (max_staleness + 1) x batch_size (ARCHITECTURE invariant 4): when the trainer
is away, rollout drains the window and then idles instead of making samples that
would only be dropped as stale.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import redis

from shared import keys
from shared.bus import FIELD
from shared.job import JobRecord, JobState, load_job, save_job
from shared.metrics import read_evals, read_ledger
from shared.schema import PromptMsg, encode
from shared.tasks import TaskItem, get_task


class Feeder:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._iters: dict[str, tuple[int, Iterator[TaskItem]]] = {}

    def _items(self, rec: JobRecord, fed: int) -> Iterator[TaskItem]:
        pos, it = self._iters.get(rec.id, (-1, iter(())))
        if pos != fed:  # first time, or after an api restart: replay to the durable position
            it = itertools.islice(get_task(rec.spec.task).train_items(rec.spec.seed), fed, None)
        return it

    def tick(self) -> int:
        """Feed every running job up to its window; returns prompts fed."""
        total = 0
        for raw_id in self.r.smembers(keys.active_jobs()):
            rec = load_job(self.r, raw_id.decode())
            if rec is None:
                continue
            if rec.state == JobState.completed:
                self._maybe_retire(rec)
                continue
            if rec.state != JobState.running:
                continue
            led = read_ledger(self.r, rec.id)
            room = rec.spec.inflight_window - led["in_flight"]
            if room <= 0:
                continue
            fed = led.get("fed", 0)
            it = self._items(rec, fed)
            pipe = self.r.pipeline(transaction=True)
            for n, item in enumerate(itertools.islice(it, room)):
                msg = PromptMsg(
                    job_id=rec.id,
                    group_id=f"{rec.id}:g{fed + n}",
                    item_id=item.item_id,
                    prompt=item.prompt,
                    fields=item.fields,
                    fed_at=time.time(),
                )
                pipe.xadd(keys.prompts(rec.id), {FIELD: encode(msg)})
            pipe.hincrby(keys.ledger(rec.id), "fed", room)
            pipe.execute()
            self._iters[rec.id] = (fed + room, it)
            total += room
        return total

    def _maybe_retire(self, rec: JobRecord) -> None:
        """A completed job leaves the active set once its final version is evaluated."""
        final = int(self.r.get(keys.policy_pointer(rec.id)) or 0)
        evaluated = {e["version"] for e in read_evals(self.r, rec.id)}
        if final in evaluated or rec.spec.eval_size == 0 or time.time() - rec.updated_at > 600:
            self.r.srem(keys.active_jobs(), rec.id)
            rec.updated_at = time.time()
            save_job(self.r, rec)
