"""Shared by the backlog tests and bench/backlog.py: jobs with a backlog, ready groups, a spiller,
and a trainer-side drain through the real group sources (no torch)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import redis

from services.api.jobs import create_job
from services.rollout.spill import Spiller
from services.trainer.sources import Sources
from shared import keys
from shared.bus import FIELD, Bus
from shared.dataset import DatasetGuard
from shared.job import JobRecord, JobSpec
from shared.lease import Lease
from shared.schema import Completion, GroupMsg, decode, encode, pack_f32, pack_i32, pack_u8
from shared.service import Health, ServiceRuntime
from shared.settings import CommonSettings
from shared.store import ObjectStore
from tests.support.jobs import small_spec
from tests.support.waits import Deadline


def spec(base_model: str = "tiny", *, batch: int = 4, group: int = 4, steps: int = 100, **backlog: object) -> JobSpec:
    bl = {"max_groups": 256, "segment_groups": 8, **backlog}
    return small_spec(base_model, name="bl", group=group, batch=batch, steps=steps, backlog=bl)


def new_job(r: redis.Redis, s: JobSpec) -> JobRecord:
    return create_job(r, spec=s)


def group(
    job_id: str, i: int, *, g: int = 4, version: int = 0, sampled_at: float | None = None, tokens: int = 4
) -> GroupMsg:
    rng = np.random.default_rng(i)
    comps = [
        Completion(
            token_ids=pack_i32(rng.integers(3, 200, tokens)),
            logprobs=pack_f32(-rng.random(tokens) * 3 - 0.5),
            loss_mask=pack_u8(np.ones(tokens, dtype=np.uint8)),
            text="x" * tokens,
            finish_reason="stop",
            reward=float((i + j) % 2),
        )
        for j in range(g)
    ]
    return GroupMsg(
        job_id=job_id,
        group_id=f"{job_id}:g{i}",
        item_id=str(i),
        prompt="p",
        prompt_ids=pack_i32(rng.integers(3, 200, 3)),
        policy_version=version,
        completions=comps,
        stage="ready",
        sampled_at=time.time() if sampled_at is None else sampled_at,
    )


def push_ready(r: redis.Redis, job_id: str, groups: list[GroupMsg]) -> None:
    """As if the api had fed them and every stage had handed them on to the ready stream."""
    pipe = r.pipeline(transaction=True)
    for g in groups:
        pipe.xadd(keys.ready(job_id), {FIELD: encode(g)})
    pipe.hincrby(keys.ledger(job_id), "fed", len(groups))
    pipe.execute()


def runtime(redis_url: str, role: str = "rollout", replica: str = "r1") -> ServiceRuntime:
    return ServiceRuntime(role, CommonSettings(redis_url=redis_url, dev=True, replica=replica))


def spiller(rt: ServiceRuntime, store: ObjectStore, replica: str = "r1") -> Spiller:
    return Spiller(rt, store, replica=replica, model=None, claim_idle_s=120)


class Drain:
    """The trainer's side without torch: its lease, bus and sources; "trains" by acknowledging."""

    def __init__(self, r: redis.Redis, store: ObjectStore, rec: JobRecord, version: int = 0) -> None:
        self.r, self.rec = r, rec
        self.lease = Lease(r, rec.id, "drain", ttl_s=60)
        assert self.lease.acquire()
        self.bus = Bus(r, keys.GROUP_TRAINER, "trainer", redo_own_pending=False)
        self.version = version
        self.src = Sources(r, store, rec, self.bus, lambda: self.lease.fence, lambda: self.version)
        self.trained: list[str] = []

    def take(self, need: int, *, first: bool = False, timeout: float = 60) -> list[tuple[object, GroupMsg]]:
        """Exactly `need` groups (a read returns fewer while a segment is still being fetched)."""
        out: list[tuple[object, GroupMsg]] = []
        deadline = Deadline(timeout)
        while len(out) < need and deadline:
            out += self.src.decode(self.src.read(need - len(out), first))
        return out

    def all(self, expect: int, timeout: float = 60) -> list[str]:
        """Take and acknowledge (as trained) until `expect` groups came, in the order they came."""
        deadline = Deadline(timeout)
        while len(self.trained) < expect and deadline:
            items = self.src.decode(self.src.read(expect - len(self.trained), False))
            if items:
                self.src.ack([ref for ref, _ in items], "trained")
                self.trained += [g.group_id for _, g in items]
        return self.trained

    def close(self) -> None:
        self.src.close()
        self.lease.release()


def group_ids_of(payloads: list[bytes]) -> list[str]:
    return [decode(p, GroupMsg).group_id for p in payloads]


def fake_rt(r: redis.Redis) -> SimpleNamespace:
    """What a JobTrainer needs of a ServiceRuntime (its dataset guard never attached: it checks nothing)."""
    return SimpleNamespace(redis=r, stop=threading.Event(), gauges={}, health=Health(), dataset=DatasetGuard(r))


def roll(r: redis.Redis, job_id: str, *, limit: int = 1000, consumer: str = "fake-rollout") -> int:
    """A stand-in for rollout (and reward): prompts become ready groups through the real bus,
    settled with the ledger counter as the stages do. Returns the groups made."""
    from shared.schema import PromptMsg

    bus = Bus(r, keys.GROUP_ROLLOUT, consumer)
    entries = bus.read([keys.prompts(job_id)], count=limit, block_ms=1)
    units = []
    for e, msg in bus.decode(entries, PromptMsg):
        i = int(msg.group_id.rsplit("g", 1)[1])
        g = group(job_id, i)
        g.group_id = msg.group_id
        units.append((e, [(keys.ready(job_id), encode(g))], {"produced": 1}))
    return bus.settle(units)
