"""The trainer's Tinker worker: holds Tinker models under their jobs' leases and applies their calls.

Each tick it takes the lease of every running Tinker model it does not hold yet (as the job
trainer takes a job's: services/trainer/claim.py), reads the models' call queues
(shared/tinker_queue.py) and applies each model's calls in seq_id order, writing each result
as the lease holder.

Exactly-once (docs/architecture.md, invariant 2): a call leaves the queue only once a
checkpoint holding its effect is in the store. A model is checkpointed every
`checkpoint_every` optimizer steps (where no gradient is pending), and at exit when it can be;
a worker that takes a model restores its newest checkpoint and applies the calls after it
again, in order, so each call's effect is in the weights once, however the previous holder
died. A call that failed keeps its failure: a replay skips it. A call that fails inside a
pass (not refused up front) may have left part of a gradient behind, so the worker goes back
to the checkpoint and replays the rest without it.

A deposed worker (its lease taken over) writes nothing more: results, checkpoints, versions
and pointer moves are all fenced (invariant 10), and it drops the model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.trainer.claim import take_lease
from services.trainer.publishing import Publisher
from services.trainer.settings import TrainerSettings
from services.trainer.tinker.model import CallRefused, TinkerModel
from shared import keys, tinker_queue
from shared.job import JobState, UnreadableJob, load_job
from shared.lease import Lease, LeaseKeeper, LeaseLost
from shared.schema import TinkerCall, TinkerResult
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore

log = logging.getLogger(__name__)
CLAIM_EVERY_S = 1.0
BLOCK_MS = 50  # a read that finds nothing waits this long for the next call


class Rewind(Exception):
    """A call failed inside a pass: the model goes back to its checkpoint and replays."""


@dataclass
class Held:
    """A model this worker holds: its lease, its state, and where it is in its queue."""

    model: TinkerModel
    lease: Lease
    keeper: LeaseKeeper
    publisher: Publisher
    applied: int  # the highest seq_id whose effect is in the weights
    cursor: str = "0"  # the last stream entry read
    buffered: dict[int, tinker_queue.QueuedCall] = field(default_factory=dict)
    since_ckpt: list[str] = field(default_factory=list)  # stream ids of calls applied since the checkpoint


class TinkerWorker:
    def __init__(self, rt: ServiceRuntime, settings: TrainerSettings, store: ObjectStore, device: str) -> None:
        self.rt, self.s, self.store, self.device = rt, settings, store, device
        self.r = rt.redis
        self.held: dict[str, Held] = {}
        self._claimed_at = 0.0

    # -- which models --------------------------------------------------------------------
    def claim(self) -> None:
        if time.monotonic() - self._claimed_at < CLAIM_EVERY_S:
            return
        self._claimed_at = time.monotonic()
        for job_id in list(self.held):  # a model whose job ended (its session closed, cancelled)
            rec = load_job(self.r, job_id)
            if rec is None or rec.state != JobState.running:
                self._release(job_id, f"its job is {'gone' if rec is None else rec.state.value}")
        for job_id in [self.s.job] if self.s.job else active_job_ids(self.r):
            if job_id in self.held:
                continue
            try:
                rec = load_job(self.r, job_id)
            except UnreadableJob as e:
                log.error("%s; skipped", e)
                continue
            if rec is None or not rec.spec.tinker or rec.state != JobState.running:
                continue
            lease = take_lease(self.rt, self.s, self.store, job_id)  # type: ignore[arg-type]
            if lease is None:
                continue
            keeper = LeaseKeeper(lease).__enter__()
            try:
                self.held[job_id] = self._load(rec, lease, keeper)
            except BaseException:
                keeper.__exit__()
                lease.release()
                raise
        self.rt.health.set("models", True, f"holding {len(self.held)} Tinker model(s)")

    def _load(self, rec, lease: Lease, keeper: LeaseKeeper) -> Held:  # noqa: ANN001
        model = TinkerModel(rec, self.s, self.device)
        seq = model.restore(self.store)
        if seq is None:
            seq = int(self.r.hget(keys.tinker_state(rec.id), "first") or 1) - 1
        publisher = Publisher(
            self.store,
            self.r,
            rec.id,
            rec.spec.base_model,
            lease=lease,
            assert_lease=lambda: self._assert(lease, keeper),
            probe_tolerance=self.s.republish_probe_tolerance,
        )
        log.info("Tinker model %s: held (epoch %d), resuming after seq_id %d", rec.id, lease.epoch, seq)
        return Held(model, lease, keeper, publisher, applied=seq)

    def _assert(self, lease: Lease, keeper: LeaseKeeper) -> None:
        keeper.check()
        if not lease.held():
            raise LeaseLost(f"job {lease.job_id}: lease lost (another trainer holds it now)")

    def _drop(self, job_id: str, why: str) -> None:
        h = self.held.pop(job_id)
        h.keeper.__exit__()
        h.lease.release()
        log.warning("Tinker model %s: dropped (%s)", job_id, why)

    # -- the loop ---------------------------------------------------------------------------
    def tick(self) -> None:
        self.claim()
        if not self.held:
            self.rt.stop.wait(0.5)
            return
        ready = any(h.applied + 1 in h.buffered for h in self.held.values())
        got = tinker_queue.read_calls(
            self.r, {j: h.cursor for j, h in self.held.items()}, block_ms=0 if ready else BLOCK_MS
        )
        for job_id, entries in got.items():
            h = self.held[job_id]
            h.cursor = max((e.entry_id for e in entries), key=_stream_order, default=h.cursor)
            for e in entries:
                if e.seq > h.applied:
                    h.buffered[e.seq] = e
        for job_id in list(self.held):
            try:
                self._drain(job_id)
            except LeaseLost as e:
                self._drop(job_id, str(e))
            except Rewind as e:
                log.error("Tinker model %s: %s; back to its checkpoint", job_id, e)
                self._reload(job_id)

    def _drain(self, job_id: str) -> None:
        h = self.held[job_id]
        while (q := h.buffered.pop(h.applied + 1, None)) is not None:
            if self.rt.stop.is_set():
                h.buffered[q.seq] = q
                return
            self._assert(h.lease, h.keeper)
            self._apply(job_id, h, q)
            h.applied = q.seq
            h.since_ckpt.append(q.entry_id)

    def _apply(self, job_id: str, h: Held, q: tinker_queue.QueuedCall) -> None:
        done = tinker_queue.read_result(self.r, job_id, q.seq)
        if done is not None and done.error:
            return  # it failed before: a replay never applies it
        if q.call is None:
            self._fail(h, job_id, q.seq, f"the queued call does not decode: {q.problem}", "server")
            return
        call = q.call
        t0 = time.perf_counter()
        try:
            result = self._run(h, call)
        except CallRefused as e:
            self._fail(h, job_id, call.seq, str(e), "user")
            return
        except LeaseLost:
            raise
        except Exception as e:  # a fault inside a pass: part of a gradient may be there
            log.exception("Tinker model %s: call %d (%s) failed", job_id, call.seq, call.kind)
            self._fail(h, job_id, call.seq, f"{type(e).__name__}: {e}", "server")
            raise Rewind(f"call {call.seq} ({call.kind}) failed inside a pass") from e
        log.debug("Tinker model %s: call %d (%s) in %.3fs", job_id, call.seq, call.kind, time.perf_counter() - t0)
        tinker_queue.write_result(self.r, h.lease.fence, result)
        if call.kind == "optim_step" and h.model.steps % self.s.checkpoint_every == 0:
            self._checkpoint(job_id, h, call.seq)

    def _run(self, h: Held, call: TinkerCall) -> TinkerResult:
        m = h.model
        if call.kind in ("forward", "forward_backward"):
            return m.forward(call, backward=call.kind == "forward_backward")
        if call.kind == "optim_step":
            return m.optim_step(call)
        fence = lambda: self._assert(h.lease, h.keeper)  # noqa: E731
        body: dict[str, object] = {"kind": call.kind, "name": call.name}
        if call.kind == "save_state":
            m.save_named(self.store, call.name, call.seq, epoch=h.lease.epoch, before_manifest=fence)
        elif call.kind == "load_state":
            m.load_named(self.store, call.source_job, call.name, optimizer=call.optimizer)
            body["source_job"] = call.source_job
        elif call.kind == "save_for_sampler":
            version = m.versions + 1
            h.publisher.publish(version, m.files(), m.probe())
            h.publisher.announce(version)
            m.versions = version
            tinker_queue.bump_versions(self.r, call.job_id, version)
            if call.name:
                self.r.hset(keys.tinker_state(call.job_id), f"sampler:{call.name}", version)
            body["version"] = version
        else:
            raise CallRefused(f"unknown call kind {call.kind!r}")
        return TinkerResult(job_id=call.job_id, seq=call.seq, body=body)

    def _fail(self, h: Held, job_id: str, seq: int, error: str, category: str) -> None:
        tinker_queue.write_result(
            self.r, h.lease.fence, TinkerResult(job_id=job_id, seq=seq, error=error, category=category)
        )

    # -- checkpoints --------------------------------------------------------------------------
    def _checkpoint(self, job_id: str, h: Held, seq: int) -> None:
        """The state after `seq` to the store, then those calls out of the queue (durable, then acknowledged)."""
        h.model.checkpoint(
            self.store, seq, epoch=h.lease.epoch, before_manifest=lambda: self._assert(h.lease, h.keeper)
        )
        tinker_queue.checkpointed(self.r, h.lease.fence, job_id, seq, h.since_ckpt)
        h.since_ckpt = []

    def _reload(self, job_id: str) -> None:
        """Back to the newest checkpoint and replay the queue from its start (failed calls skipped)."""
        h = self.held[job_id]
        seq = h.model.restore(self.store)
        if seq is None:  # never checkpointed: a fresh adapter, as created
            h.model = TinkerModel(h.model.rec, self.s, self.device)
            seq = int(self.r.hget(keys.tinker_state(job_id), "first") or 1) - 1
        h.model.opt.zero_grad(set_to_none=True)
        h.model.dirty = False
        h.applied, h.cursor, h.buffered, h.since_ckpt = seq, "0", {}, []

    def _release(self, job_id: str, why: str) -> None:
        """Checkpoint a model that has applied calls since its checkpoint and holds no pending
        gradient (one mid-accumulation replays them in its next holder), then hand back its lease."""
        h = self.held[job_id]
        try:
            if h.since_ckpt and not h.model.dirty:
                self._checkpoint(job_id, h, h.applied)
        except Exception as e:  # noqa: BLE001 - the queue keeps the calls: the next holder replays them
            log.error("Tinker model %s: checkpoint before letting it go failed: %s", job_id, e)
        self._drop(job_id, why)

    def close(self) -> None:
        """At exit: every model let go (checkpointed where it can be)."""
        for job_id in list(self.held):
            self._release(job_id, "worker stopping")


def _stream_order(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    return int(ms), int(n or 0)
