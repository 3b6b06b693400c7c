"""A job's feed loop without an engine, for the trainer's window tests: the real feeder keeps the
prompt stream at the job's window (in this process, or the api as a process), and `Sampler`, a
stand-in for rollout and reward, turns each prompt into a ready group sampled at the current
policy version, through the real bus. The trainer under test consumes them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis

from services.api.feeder import Feeder
from shared import keys
from shared.bus import Bus
from shared.job import JobState, load_job
from shared.policy import read_pointer
from shared.schema import PromptMsg, encode
from shared.store import ObjectStore
from tests.support.backlog import group
from tests.support.stack import wait_for


class Sampler(threading.Thread):
    """Prompts of `job_id` become ready groups of `g` completions (rewards with spread), each
    sampled at the policy pointer's version, settled with the stages' ledger counters. With
    `limit`, it makes that many groups and no more: the trainer then waits mid-job, however fast
    it trains (a test polling for "N steps done" would otherwise find the job already over)."""

    def __init__(self, r: redis.Redis, job_id: str, *, g: int, limit: int | None = None) -> None:
        super().__init__(name=f"sampler-{job_id}", daemon=True)
        self.r, self.job_id, self.g, self.limit = r, job_id, g, limit
        self.stop = threading.Event()
        self.made = 0

    def run(self) -> None:
        bus = Bus(self.r, keys.GROUP_ROLLOUT, "sampler")
        while not self.stop.is_set():
            count = 64 if self.limit is None else min(64, self.limit - self.made)
            if count <= 0:
                self.stop.wait(0.1)
                continue
            entries = bus.read([keys.prompts(self.job_id)], count=count, block_ms=100)
            version = read_pointer(self.r, self.job_id)
            units = []
            for e, msg in bus.decode(entries, PromptMsg):
                g = group(self.job_id, self.made + len(units), g=self.g, version=version)
                g.group_id, g.item_id = msg.group_id, msg.item_id
                units.append((e, [(keys.ready(self.job_id), encode(g))], {"produced": 1, "scored": 1}))
            self.made += bus.settle(units)


class FeedLoop(threading.Thread):
    """The api's feeder, ticking in this process."""

    def __init__(self, r: redis.Redis, store: ObjectStore) -> None:
        super().__init__(name="feeder", daemon=True)
        self.feeder = Feeder(r, store)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.feeder.tick()
            time.sleep(0.02)


def stop_all(*threads: Sampler | FeedLoop) -> None:
    """Stop and join each of `threads` that was started."""
    for t in threads:
        t.stop.set()
    for t in threads:
        if t.ident is not None:
            t.join(timeout=10)


def sample_until(  # noqa: ANN001 (launcher: tests.support.launched's, for its logs on a timeout)
    r: redis.Redis,
    job_id: str,
    g: int,
    pred: Callable[[], object],
    timeout: float,
    what: str,
    launcher=None,
    *,
    limit: int | None = None,
) -> None:
    """A Sampler (making at most `limit` groups) serves `job_id` until `pred()` holds (at most
    `timeout` s), then stops."""
    sampler = Sampler(r, job_id, g=g, limit=limit)
    sampler.start()
    try:
        wait_for(pred, timeout, what, launcher)
    finally:
        stop_all(sampler)


def completed(r: redis.Redis, job_id: str) -> Callable[[], bool]:
    """A predicate: `job_id` is in state completed."""
    return lambda: (rec := load_job(r, job_id)) is not None and rec.state == JobState.completed
