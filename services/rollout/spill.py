"""Rollout's spiller: ready groups beyond the hot window go to the backlog's disk segments.

docs/architecture.md, invariant 4: while no trainer takes them, a job with a backlog keeps
generating. Redis keeps the hot window of its ready stream; this thread (one per rollout
replica, beside the engine loop) moves what lies beyond it into the object store, so the
backlog is bounded by disk rather than by Redis memory (shared/backlog.py has the format).

Per segment, exactly once:
1. take `segment_groups` entries as consumer `spill-<replica>` of the trainer's group (only
   entries never delivered to anyone, the oldest first; our own pending ones first, and those
   of spillers whose replica's heartbeat expired; never the trainer's);
2. write the segment: its data file, then its manifest;
3. in one script (Bus.spill): check each entry is still pending to us, XACK them, bump the
   ledger's `spilled`, index the segment.
A pass takes up to SEGMENTS_PER_PASS segments' entries from Redis and hands each to one of
SPILL_WRITERS threads for 2 and 3, so the store's writes overlap each other and the reads.
A crash before 3 leaves the entries pending, to be spilled again into a new segment; the
first one, never indexed, is an orphan that nobody trains and the sweep deletes by age.

A store that fails makes the spiller pause (with back-off) and say so: the `spill` check in
/readyz (degraded: generation goes on into the hot window), the log, and a metric. The
feeder stops feeding once the hot limit is reached, so Redis never fills up meanwhile.

It also keeps the backlog visible and honest: gauges in /metrics, a `backlog` metric point
per job (with rollout's idle fraction), a `backlog:<job>` check in /readyz naming the budget
that is full when the feeder cannot feed (rollout idles then, and drops nothing), and, while
no trainer holds the job, it drops segments past the age limit (dropped_age) so that expired
data never holds the budget.

`python -m services.rollout.spill` runs a spill-only replica (no engine).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import redis
from prometheus_client import Counter, Gauge

from shared import keys
from shared.backlog import expire_segments, feed_room, read_index, summary
from shared.bus import Bus, Entry, undelivered
from shared.job import JobRecord, JobState, UnreadableJob, load_job, same_model
from shared.metrics import read_ledger, record_point
from shared.policy import read_pointer
from shared.segments import GroupHead, delete_segment, group_head, new_segment_id, pack, stored_segments, write_segment
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore

log = logging.getLogger(__name__)
INTERVAL_S = 0.5  # between passes over the jobs
SEGMENTS_PER_PASS = 16  # per job and pass, so one job's backlog never starves the others' spills
SPILL_WRITERS = 4  # segments written to the store at once (each one object write plus its manifest)
POINT_EVERY_S = 10.0  # backlog metric points and gauges
EXPIRE_EVERY_S = 30.0
ORPHAN_EVERY_S = 600.0
ORPHAN_AGE_S = 3600.0  # an unindexed segment this old is an orphan (a spill that crashed, a refused segment)
MAX_BACKOFF_S = 60.0


@dataclass
class _JobClock:
    point: float = 0.0
    expire: float = 0.0
    orphans: float = field(default_factory=time.monotonic)  # not at start: let a crashed spill's redo index first


class Spiller:
    def __init__(
        self, rt: ServiceRuntime, store: ObjectStore, *, replica: str, model: str | None, claim_idle_s: float
    ) -> None:
        """`model`: spill only jobs of this base model (those this rollout pool serves); None: all."""
        self.rt, self.store, self.model = rt, store, model
        self.r = rt.redis
        self.bus = Bus(
            self.r,
            keys.GROUP_TRAINER,
            keys.SPILL_CONSUMER + replica,
            redo_own_pending=False,
            claim_idle_ms=int(claim_idle_s * 1000),
            heartbeat_role="rollout",
            owner_prefix=keys.SPILL_CONSUMER,
        )
        self._clocks: dict[str, _JobClock] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._backoff_until = 0.0
        self._failures = 0
        reg = rt.registry
        self.m_groups = Gauge("burstrl_backlog_groups", "Groups in the backlog's disk segments", ["job"], registry=reg)
        self.m_bytes = Gauge("burstrl_backlog_bytes", "Bytes of the backlog's disk segments", ["job"], registry=reg)
        self.m_segments = Gauge("burstrl_backlog_segments", "Indexed backlog segments", ["job"], registry=reg)
        self.m_age_v = Gauge(
            "burstrl_backlog_oldest_versions",
            "Policy versions behind of the oldest backlog group",
            ["job"],
            registry=reg,
        )
        self.m_age_h = Gauge("burstrl_backlog_oldest_hours", "Age of the oldest backlog group", ["job"], registry=reg)
        self.m_full = Gauge("burstrl_backlog_full", "1 while the feeder cannot feed the job", ["job"], registry=reg)
        self.m_spilled = Counter("burstrl_backlog_spilled_groups", "Groups spilled", ["job"], registry=reg)
        self.m_spilled_bytes = Counter("burstrl_backlog_spilled_bytes", "Bytes spilled", ["job"], registry=reg)
        self.m_failures = Counter("burstrl_backlog_spill_failures", "Segment writes that failed", registry=reg)
        self.rt.health.set("spill", True, scope="job")

    # -- the thread ------------------------------------------------------------------
    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name="spill", daemon=True)
        t.start()
        return t

    def run(self) -> None:
        while not self.rt.stop.is_set():
            self.rt.survive(self.tick)
            self.rt.stop.wait(INTERVAL_S)

    def leave(self, thread: threading.Thread, timeout_s: float) -> None:
        """Once `rt.stop` is set: let the pass in progress finish (its segments indexed), then
        hand what this spiller still holds to a live peer spiller (Bus.leave)."""
        thread.join(timeout_s)
        if thread.is_alive():  # a store that hangs: its entries stay pending, taken once our heartbeat is gone
            log.warning("spill pass still running after %.0fs; leaving its entries to the next spiller", timeout_s)
            return
        left = self.bus.leave(keys.ready(j) for j in active_job_ids(self.r))
        if left.handed or left.held:
            log.info(
                "spiller left: %d ready groups handed to peers, %d held for the next spiller", left.handed, left.held
            )

    def tick(self) -> int:
        """One pass over the jobs with a backlog; returns the groups spilled."""
        spilled = 0
        for rec in self._jobs():
            try:
                spilled += self._job(rec)
            except redis.ConnectionError:
                raise
            except Exception:  # one job's trouble must not stop the others' spills
                log.exception("job %s: backlog pass failed; other jobs carry on", rec.id)
        return spilled

    def _jobs(self) -> list[JobRecord]:
        out = []
        for job_id in active_job_ids(self.r):
            try:
                rec = load_job(self.r, job_id)
            except UnreadableJob as e:
                log.error("%s; not spilled", e)
                continue
            if rec is None or not rec.spec.backlog.enabled or rec.state not in (JobState.running, JobState.paused):
                continue
            if self.model is None or same_model(rec.spec.base_model, self.model):
                out.append(rec)
        for gone in set(self._clocks) - {rec.id for rec in out}:
            self._forget(gone)
        return out

    def _job(self, rec: JobRecord) -> int:
        clock = self._clocks.setdefault(rec.id, _JobClock())
        now = time.monotonic()
        if now - clock.expire >= EXPIRE_EVERY_S:
            clock.expire = now
            # Only while no trainer holds the job (mark_done checks, atomically); a trainer drops them itself.
            if n := expire_segments(self.r, self.store, rec, read_pointer(self.r, rec.id), fence=None):
                log.warning("job %s: dropped %d backlog groups past the age limit (dropped_age)", rec.id, n)
        spilled = self.spill_pass(rec)
        if now - clock.orphans >= ORPHAN_EVERY_S:
            clock.orphans = now
            self.sweep_orphans(rec.id)
        self._report(rec, clock, now)
        return spilled

    # -- spilling ----------------------------------------------------------------------
    def spill_pass(self, rec: JobRecord) -> int:
        """Spill what lies beyond the job's hot window, up to SEGMENTS_PER_PASS segments; returns
        the groups spilled. Waits for its writes: the next pass's own pending entries are then
        only those whose write failed."""
        if time.monotonic() < self._backoff_until:
            return 0
        spec, stream = rec.spec, keys.ready(rec.id)
        size, most = spec.backlog.segment_groups, spec.backlog.segment_groups * SEGMENTS_PER_PASS
        own = self.bus.read_own(stream, count=most)  # spills that failed before their script
        if not own and self.bus.take_from_gone(stream, count=most):
            own = self.bus.read_own(stream, count=most)  # a dead spiller's
        writes = [self._write(rec, own[i : i + size]) for i in range(0, len(own), size)]
        hot = spec.inflight_window  # the trainer takes these straight from Redis
        beyond = undelivered(self.r, stream, keys.GROUP_TRAINER, limit=hot + most) - hot
        n = min(beyond // size, SEGMENTS_PER_PASS - len(writes))
        if n > 0:
            new = self.bus.read_new(stream, count=n * size)  # whole segments only, one round trip
            writes += [self._write(rec, new[i : i + size]) for i in range(0, len(new), size)]
        return sum(w.result() for w in writes)

    def _write(self, rec: JobRecord, entries: list[Entry]) -> Future[int]:
        """Read each group's head here (what does not decode is dead-lettered), then write and index
        in a writer thread."""
        items: list[tuple[Entry, GroupHead]] = []
        for e in entries:
            try:
                items.append((e, group_head(e.data)))
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as err:
                self.bus.dead_letter(e, f"undecodable GroupMsg: {err}")
        seg = new_segment_id(self.r, rec.id)  # taken in stream order: the trainer's `oldest` order
        if self._pool is None:
            self._pool = ThreadPoolExecutor(SPILL_WRITERS, thread_name_prefix="spill-write")
        if not items:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        return self._pool.submit(self._write_and_index, rec.id, seg, [e for e, _ in items], [g for _, g in items])

    def _write_and_index(self, job_id: str, seg: str, entries: list[Entry], groups: list[GroupHead]) -> int:
        data, info = pack([e.data for e in entries], groups)
        try:
            write_segment(self.store, job_id, seg, data, info)
        except Exception as e:  # the store is down or refusing: pause, say so; the entries stay pending to us
            self._store_failed(e)
            return 0
        if self._failures:
            log.info("the object store takes segments again; spilling resumed")
            self._failures = 0
            self.rt.health.set("spill", True, scope="job")
        n = self.bus.spill(entries, seg, info.to_json())
        if n == 0:  # an entry was taken over meanwhile (the trainer): this copy must never be trained
            try:
                delete_segment(self.store, job_id, seg)
            except Exception as e:  # noqa: BLE001 (the orphan sweep deletes it later)
                log.warning("job %s: could not delete unindexed segment %s: %s", job_id, seg, e)
            return 0
        self.m_spilled.labels(job_id).inc(n)
        self.m_spilled_bytes.labels(job_id).inc(info.bytes)
        log.debug("job %s: spilled %d groups (%d bytes) into %s", job_id, n, info.bytes, seg)
        return n

    def _store_failed(self, e: Exception) -> None:
        self._failures += 1
        self.m_failures.inc()
        wait = min(MAX_BACKOFF_S, 2.0 ** min(self._failures, 6))
        self._backoff_until = time.monotonic() + wait
        why = f"object store {self.store.url} refuses segment writes ({type(e).__name__}: {str(e)[:200]}); "
        why += f"spilling paused, next try in {wait:.0f}s; rollout generates into the hot window until it is full"
        log.warning("%s", why)
        self.rt.health.set("spill", False, why, scope="job")

    def sweep_orphans(self, job_id: str) -> int:
        """Delete stored segments no index names (a spill that crashed before its script, a refused
        segment kept for inspection) once they are ORPHAN_AGE_S old (by the time in their id)."""
        try:
            indexed = set(read_index(self.r, job_id))
            n = 0
            for seg in stored_segments(self.store, job_id):
                if seg in indexed or time.time() - _created(seg) < ORPHAN_AGE_S:
                    continue
                delete_segment(self.store, job_id, seg)
                n += 1
            if n:
                log.info("job %s: deleted %d orphaned backlog segments", job_id, n)
            return n
        except redis.ConnectionError:
            raise
        except Exception as e:  # noqa: BLE001 (clutter: the next sweep tries again)
            log.warning("job %s: orphan sweep failed: %s", job_id, e)
            return 0

    # -- what the backlog looks like -------------------------------------------------
    def _report(self, rec: JobRecord, clock: _JobClock, now: float) -> None:
        led = read_ledger(self.r, rec.id)
        room, full = feed_room(self.r, rec, led)
        name = f"backlog:{rec.id}"
        if room <= 0 and rec.state == JobState.running:
            self.rt.health.set(
                name, False, f"job {rec.id}: {full}; rollout idles until a trainer takes groups", scope="job"
            )
        else:
            self.rt.health.set(name, True, scope="job")
        # With the readiness check, not with the rate-limited series below: /readyz and /metrics
        # must not disagree on whether the backlog is full (they did for up to POINT_EVERY_S).
        self.m_full.labels(rec.id).set(0 if room > 0 else 1)
        if now - clock.point < POINT_EVERY_S:
            return
        clock.point = now
        s = summary(self.r, rec, read_pointer(self.r, rec.id), led)
        if s is None:
            return
        self.m_groups.labels(rec.id).set(s["groups"])
        self.m_bytes.labels(rec.id).set(s["bytes"])
        self.m_segments.labels(rec.id).set(s["segments"])
        self.m_age_v.labels(rec.id).set(s["oldest_versions"] or 0)
        self.m_age_h.labels(rec.id).set(s["oldest_hours"] or 0.0)
        idle = self.rt.registry.get_sample_value("burstrl_rollout_idle_fraction")
        if idle is not None:
            self.rt.gauges["idle_frac"] = round(idle, 4)
        point = {k: v for k, v in s.items() if k not in ("order", "max_groups", "max_bytes")}
        record_point(self.r, rec.id, "backlog", {**point, "in_flight": led["in_flight"], "rollout_idle_frac": idle})

    def _forget(self, job_id: str) -> None:
        self._clocks.pop(job_id, None)
        self.rt.health.set(f"backlog:{job_id}", True, "job no longer served", scope="job")
        for m in (self.m_groups, self.m_bytes, self.m_segments, self.m_age_v, self.m_age_h, self.m_full):
            try:
                m.remove(job_id)
            except KeyError:
                pass


def _created(seg: str) -> float:
    """The creation time a segment id carries (shared/segments.py, new_segment_id); 0 if unparsable."""
    try:
        return int(seg.split("-")[1]) / 1e9
    except (IndexError, ValueError):
        return 0.0


def main() -> None:
    """A spill-only replica: the spiller with its health, metrics and heartbeat, and no engine."""
    from services.rollout.settings import RolloutSettings
    from shared.service import setup_logging
    from shared.store import open_store

    setup_logging("rollout")
    settings = RolloutSettings()
    rt = ServiceRuntime("rollout", settings)
    rt.start()
    rt.preflight()
    spiller = Spiller(
        rt,
        open_store(settings.store_url),
        replica=settings.replica,
        model=settings.model,
        claim_idle_s=settings.claim_idle_s,
    )
    try:
        spiller.run()
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
