"""The trainer's run loop: gather batches from a claimed job's ready stream, step, publish, ack.
What it trains (the job's policy, sharded under FSDP, its learner, and the newest checkpoint
restored into them) comes from services/trainer/build.py.

Order per step (docs/architecture.md, invariant 2): train -> [checkpoint every N steps: weights,
optimizer, scheduler, RNG, data position, the ids of the groups trained since the
previous checkpoint] -> publish policy v{step} -> [after a checkpoint: XACK the entries
it holds + ledger in one MULTI] -> move the policy pointer. A crash anywhere leaves the
unacknowledged entries pending; on restart the trainer restores the newest checkpoint,
re-publishes its version if that was lost, acks redelivered groups the checkpoint
already contains, and re-trains the rest first: each group counts exactly once.

Groups come from the ready stream and, for a job with a backlog, from its disk segments
(services/trainer/sources.py): both are acknowledged the same way, once their checkpoint is
stored, fenced by the lease.

Burst sessions: with a time budget (or deadline) the trainer measures its own step and
save-and-upload times and, before the budget runs out, checkpoints and exits cleanly;
on SIGTERM it abandons a batch it has not yet applied (it stays pending for the next
session), checkpoints what it has, and exits 0. With leave_when_idle_s it also leaves once the
backlog is drained: no batch for that long and no segment left. A partial batch stays pending
for the next session.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import redis

from services.trainer.admit import not_trainable, staleness_limit, too_old
from services.trainer.build import build_trainable
from services.trainer.checkpoint import prune_checkpoints, save_checkpoint
from services.trainer.distributed import CMD_FILES, CMD_OPTIMIZER, CMD_PROBE, CMD_STEP, CMD_STOP, Comm
from services.trainer.learner import Aborted, TrainResult
from services.trainer.policy import policy_files
from services.trainer.probe import compute_probe
from services.trainer.progress import BatchWait, JobStuck, StaleStreak, clear_failures
from services.trainer.publishing import Publisher
from services.trainer.retention import Retention, prune_versions
from services.trainer.settings import TrainerSettings
from services.trainer.sharding import full_optimizer_tensors, gathered_policy_files
from services.trainer.sources import Ref, SegmentRef, Sources
from services.trainer.step_report import Session, StepTimes, step_point, zero_variance
from shared import keys
from shared.backlog import held_back
from shared.bus import Bus
from shared.job import JobRecord, JobState, load_job, set_state
from shared.lease import Lease, LeaseKeeper, LeaseLost
from shared.metrics import read_ledger, record_point, record_session_point
from shared.policy import read_manifest
from shared.schema import GroupMsg, decode
from shared.service import ServiceRuntime
from shared.store import ObjectStore, StoreError

log = logging.getLogger(__name__)
CONSUMER = "trainer"  # one trainer per job (leased), so a fixed name finds its own pending entries


class JobTrainer:
    def __init__(
        self,
        rt: ServiceRuntime,
        settings: TrainerSettings,
        store: ObjectStore,
        rec: JobRecord,
        *,
        lease: Lease | None = None,
        keeper: LeaseKeeper | None = None,
        comm: Comm | None = None,
        session_start: float | None = None,
    ) -> None:
        self.rt, self.s, self.store, self.rec = rt, settings, store, rec
        # The lease this trainer holds on the job (rank 0 only; followers write nothing).
        self.lease, self.keeper = lease, keeper
        self.comm = comm or Comm()
        self.r = rt.redis
        # The trainer keeps entries pending across reads until a checkpoint holds them.
        self.bus = Bus(
            self.r,
            keys.GROUP_TRAINER,
            CONSUMER,
            redo_own_pending=False,
            claim_idle_ms=int(settings.claim_idle_s * 1000),
        )
        # The policy on its device (sharded under FSDP), its learner, and the newest checkpoint in them.
        built = build_trainable(settings, store, rec, self.comm)
        self.model, self.tok, self.sharded, self.learner = built.model, built.tok, built.sharded, built.learner
        self.state = built.state
        # The newest checkpoint's interval: its groups may be redelivered (acknowledged, not trained).
        self.ckpt_groups = set(self.state.trained_groups)
        self._bus_seen = 0.0  # bus seconds already reported in a metric point
        self.since_ckpt: list[tuple[Ref, str]] = []  # trained, not yet in a checkpoint (so not acked)
        self.pending: list[tuple[Ref, GroupMsg]] = []
        # The ready stream and the backlog's segments, in the job's order (sources.py).
        self.src = Sources(self.r, store, rec, self.bus, self._fence, lambda: self.state.step)
        self.dropped_zero_var = 0  # this session, for metrics (the ledger holds the durable count)
        # Budget: measured durations (seconds) of recent steps and checkpoint saves.
        start = session_start if session_start is not None else time.time()
        deadlines = [
            d for d in (settings.deadline, start + settings.time_budget_s if settings.time_budget_s else 0) if d
        ]
        self.deadline = min(deadlines) if deadlines else 0.0
        self.step_times: deque[float] = deque(maxlen=5)
        self.save_times: deque[float] = deque(maxlen=5)
        self.publish_times: deque[float] = deque(maxlen=5)
        self.exit_reason = ""
        self.lease_lost = ""  # why the lease was lost, if it was (the trainer's `job` check says it)
        self.publisher = Publisher(
            store,
            self.r,
            rec.id,
            rec.spec.base_model,
            lease=lease,
            assert_lease=self._assert_lease,
            probe_tolerance=settings.republish_probe_tolerance,
        )
        self.session = Session(process_start=start, epoch=lease.epoch if lease else 0, replica=settings.replica, step=0)
        self.waiting = BatchWait(self.r, rec, rt.health, report_s=settings.wait_report_s)
        self.progress = StaleStreak(
            max_staleness=staleness_limit(rec.spec),
            limit=settings.stuck_groups,
            grace_s=settings.stuck_grace_s,
            published_at=self._published_at,
        )
        if self.state.step > 0 and self.comm.is_main:
            self._publish_if_missing()  # a crash may have come between the checkpoint and its version

    # -- the loop --------------------------------------------------------------------
    def run(self) -> None:
        if not self.comm.is_main:
            self._follow()
            return
        spec = self.rec.spec
        first = True  # our own pending entries (from before a crash) come first
        t_wait = time.time()
        self.session.first_step = self.state.step
        self._session_point("start")
        try:
            while self.state.step < spec.steps:
                if self.rt.stop.is_set():
                    self.exit_reason = "stop requested (SIGTERM)"
                    break
                if self._out_of_budget(about_to_step=False):
                    break
                self._assert_lease()
                rec = load_job(self.r, self.rec.id)
                if rec is None or rec.state in (JobState.cancelled, JobState.failed):
                    # Nothing is checkpointed: a cancelled job's groups are not trained any more.
                    self.exit_reason = "its record vanished" if rec is None else f"it was {rec.state.value}"
                    log.warning("job %s: stopping at step %d: %s", self.rec.id, self.state.step, self.exit_reason)
                    return
                need = spec.batch_size - len(self.pending)
                if self.since_ckpt and (why := self._held_back()):
                    # What we trained fills the window: only its checkpoint (and ack) frees room.
                    dt = self._checkpoint()
                    log.info(
                        "job %s: checkpoint at step %d (%.2fs) before checkpoint_every: %s",
                        self.rec.id,
                        self.state.step,
                        dt,
                        why,
                    )
                entries = self._read(need, first)
                first = False
                self._admit(entries)
                if len(self.pending) < spec.batch_size:
                    self.waiting.check(time.time() - t_wait, len(self.pending), len(self.since_ckpt))
                if len(self.pending) >= spec.batch_size:
                    if self._out_of_budget(about_to_step=True):
                        break
                    wait_s = time.time() - t_wait
                    try:
                        self._step(self.pending[: spec.batch_size], wait_s)
                    except Aborted:
                        self.exit_reason = "stop requested (SIGTERM) mid-batch; batch left pending"
                        break
                    self.pending = self.pending[spec.batch_size :]
                    t_wait = time.time()
                elif self._drained(waited_s=time.time() - t_wait):
                    break
            self._checkpoint_if_dirty()
        except JobStuck as e:
            self._checkpoint_if_dirty()
            set_state(self.r, self.rec.id, JobState.failed, only_from={JobState.running}, error=str(e))
            log.error("job %s: failed: %s", self.rec.id, e)
            self.exit_reason = "job cannot make progress"
            return
        except LeaseLost as e:
            # Another trainer owns the job now, or Redis lost the lease with its data: whatever we
            # trained since our last checkpoint stays unacknowledged, and nothing of ours may be
            # written any more.
            log.error("%s; stopping without writing anything more", e)
            self.exit_reason, self.lease_lost = "lost the lease", str(e)
            return
        finally:
            self.src.close()
            self.comm.broadcast_int(CMD_STOP)
            self._session_point("end")
        if self.exit_reason.startswith(("time budget", "drained")):
            log.info("job %s: %s; exiting the session", self.rec.id, self.exit_reason)
            self.rt.stop.set()  # a burst session ends here; the next one resumes from the store
        elif self.exit_reason:
            log.info("job %s: %s", self.rec.id, self.exit_reason)
        if self.state.step >= spec.steps:
            if set_state(self.r, self.rec.id, JobState.completed, only_from={JobState.running}):
                log.info("job %s: completed %d steps", self.rec.id, spec.steps)

    def _session_point(self, event: str) -> None:
        """The burst timeline: when this trainer held the job, what it cost and what it trained."""
        if lost := self._redis_lost():
            # Written into an emptied Redis, the point would recreate keys of a job it no longer
            # knows, and they would outlive a recovery (invariant 11: losing state is loud, not papered over).
            log.warning("job %s: session %s not recorded: %s", self.rec.id, event, lost)
            return
        try:
            record_session_point(self.r, self.rec.id, self.session.point(event, reason=self.exit_reason))
        except redis.RedisError as e:  # a report, not a correctness matter: never mask the real exit
            log.warning("job %s: could not record the session %s: %s", self.rec.id, event, e)

    def _follow(self) -> None:
        """Ranks > 0: train each batch rank 0 broadcasts, and join each gather it announces
        (FSDP), until it says stop."""
        while (cmd := self.comm.broadcast_int(0)) != CMD_STOP:
            if cmd == CMD_STEP:
                groups = [decode(b, GroupMsg) for b in self.comm.broadcast_bytes(None)]
                self.learner.train_batch(groups)
                self.state.step += 1
            elif cmd == CMD_FILES:
                self._policy_files()
            elif cmd == CMD_OPTIMIZER:
                full_optimizer_tensors(self.learner.opt)
            elif cmd == CMD_PROBE:
                compute_probe(self.model, self.tok, self.rec.spec.task, self.s.logits_chunk)
            else:  # CMD_EXIT: rank 0 gave up mid-job (its error is in its log); end this rank too
                raise RuntimeError(f"rank {self.comm.rank}: rank 0 sent command {cmd} while a job was open")

    def _collective(self, cmd: int) -> None:
        """Rank 0, before a gather or a forward under FSDP: bring the followers into it."""
        if self.sharded and self.comm.world > 1 and self.comm.is_main:
            self.comm.broadcast_int(cmd)

    def _policy_files(self) -> dict[str, bytes]:
        """The policy files of the current weights (on a follower under FSDP: its part of the gather)."""
        if not self.sharded:
            return policy_files(self.model, self.rec.spec.base_model)
        self._collective(CMD_FILES)
        return gathered_policy_files(self.model, self.rec.spec.base_model, main=self.comm.is_main)

    def _out_of_budget(self, *, about_to_step: bool) -> bool:
        """Whether a (step and) a checkpoint would no longer fit before the deadline."""
        if not self.deadline:
            return False
        # Before the first checkpoint, estimate its upload from the policy uploads: the
        # optimizer state (AdamW: 2x the trainable weights) makes it ~3x a version.
        save = max(self.save_times, default=3 * max(self.publish_times, default=0.0))
        need = save + self.s.budget_margin_s + (max(self.step_times, default=0.0) if about_to_step else 0.0)
        left = self.deadline - time.time()
        if left < need:
            self.exit_reason = (
                f"time budget: {left:.1f}s left, a {'step + ' if about_to_step else ''}save needs ~{need:.1f}s"
            )
            return True
        return False

    def _drained(self, *, waited_s: float) -> bool:
        """Whether a burst session should leave: no batch formed for leave_when_idle_s and no
        backlog segment left to read. What is pending stays unacknowledged for the next session."""
        limit = self.s.leave_when_idle_s
        if not limit or waited_s < limit or self.src.segments_waiting():
            return False
        self.exit_reason = f"drained: no batch for {waited_s:.1f}s (leave_when_idle_s {limit:g})"
        return True

    def _admit(self, entries: list[Ref]) -> None:
        spec, version, now = self.rec.spec, self.state.step, time.time()
        queued = {g.group_id for _, g in self.pending} | {gid for _, gid in self.since_ckpt}
        held = {e.id for e, _ in self.pending} | {e.id for e, _ in self.since_ckpt}
        # Our own entry again (re-read of our pending list, or reclaimed from ourselves): it is
        # acknowledged with its checkpoint, not before.
        fresh = [e for e in entries if e.id not in held]
        for e, g in self.src.decode(fresh):
            if g.group_id in self.ckpt_groups:
                # Redelivered after a crash between storing the checkpoint and acking it: its
                # gradient is in the weights, and the ack (with its ledger count) never happened.
                self._ack([e], "trained")
            elif why := not_trainable(g, spec):
                self.src.dead_letter(e, why)
            elif old := too_old(g, spec, version, now):  # dropped_stale, or dropped_age with a backlog
                self._ack([e], old)
                if version - g.policy_version > staleness_limit(spec):
                    self.progress.stale(g, version)
            elif spec.algorithm.dynamic_sampling and zero_variance(g):
                # DAPO dynamic sampling: no advantage signal; the batch fills with informative groups.
                self._ack([e], "dropped_zero_variance")
                self.dropped_zero_var += 1
            elif g.group_id in queued:
                # Another entry carrying a group we already hold; the ledger counted the group
                # once, so this extra copy is acknowledged without a count.
                self.src.ack([e], None)
            else:
                self.pending.append((e, g))
                queued.add(g.group_id)
        if why := self.progress.stuck():
            raise JobStuck(why)

    def _held_back(self) -> str:
        """Why the next batch cannot form before the groups trained since the last checkpoint are
        acknowledged ("" when it can): shared/backlog.py, `held_back`."""
        led = read_ledger(self.r, self.rec.id)
        return held_back(self.r, self.rec, led, trained_unacked=len(self.since_ckpt))

    def _read(self, need: int, first: bool) -> list[Ref]:
        try:
            return self.src.read(need, first)
        except redis.ResponseError:
            # Redis answers a read blocked on a stream that vanished (FLUSHALL, a deleted job) with
            # "UNBLOCKED the stream key no longer exists": when the lease went with it, that is a
            # lost lease (said why, nothing more written), not the job's failure.
            self._assert_lease()
            raise

    def _ack(self, entries: list[Ref], counter: str) -> None:
        """Acknowledge with one ledger count each, as the lease holder (raises LeaseLost if not)."""
        self.src.ack(entries, counter)

    def _fence(self):  # noqa: ANN202 (Fence | None)
        return self.lease.fence if self.lease is not None else None

    def _assert_lease(self) -> None:
        """Before every write only the holder may make (a manifest, a pointer move): raises LeaseLost."""
        if self.lease is None:
            return
        if self.keeper is not None:
            self.keeper.check()
        if not self.lease.held():
            why = self.lease.lost_reason()
            if lost := self._redis_lost():
                why += f"; {lost}"
            raise LeaseLost(f"job {self.rec.id}: lease lost: {why}")

    def _redis_lost(self) -> str:
        """Why Redis no longer holds the dataset this service started on ("" while it does)."""
        return self.rt.dataset.check()

    def _step(self, items: list[tuple[Ref, GroupMsg]], wait_s: float) -> None:
        spec = self.rec.spec
        t0 = time.time()
        groups = [g for _, g in items]
        if self.comm.world > 1:
            self.comm.broadcast_int(CMD_STEP)
            self.comm.broadcast_bytes([e.data for e, _ in items])
            should_stop = lambda: False  # noqa: E731 (ranks must agree; a DDP batch always finishes)
        else:
            should_stop = self.rt.stop.is_set
        res = self.learner.train_batch(groups, should_stop=should_stop)
        t_train = time.time() - t0
        self.state.step += 1
        self.since_ckpt.extend((e, g.group_id) for e, g in items)
        d = self.state.data
        d["groups_trained"] = d.get("groups_trained", 0) + len(items)
        d["last_entry_id"] = items[-1][0].id
        files = self._policy_files()
        t_ckpt = 0.0
        checkpointed = self.state.step % self.s.checkpoint_every == 0 or self.state.step >= spec.steps
        if checkpointed:
            t_ckpt = self._checkpoint(files, ack=False)  # durable first (invariant 2) ...
        t1 = time.time()
        self._publish(files)
        self.publish_times.append(time.time() - t1)
        # Pointer before the ack: the ack frees feeder room, and prompts fed then should
        # find the new version already announced, so rollout samples them with it.
        self._advance_pointer()
        if checkpointed:
            self._ack_checkpointed()  # ... then acknowledged
        t_pub = time.time() - t0 - t_train - t_ckpt
        self.step_times.append(t_train + t_pub)
        self.progress.trained()
        self.waiting.stepped()
        if self.state.step == 1 or checkpointed:
            clear_failures(self.r, self.rec.id)  # it loads and trains: earlier failures were transient
        self._record(items, res, wait_s=wait_s, t_train=t_train, t_pub=t_pub, t_ckpt=t_ckpt, checkpointed=checkpointed)

    def _record(
        self,
        items: list[tuple[Ref, GroupMsg]],
        res: TrainResult,
        *,
        wait_s: float,
        t_train: float,
        t_pub: float,
        t_ckpt: float,
        checkpointed: bool,
    ) -> None:
        groups = [g for _, g in items]
        # Time inside the bus (reads that found data, settle scripts) since the last point:
        # what the Redis transport costs a step, blocking for new data excluded.
        bus_total = self.bus.stats.read_s + self.bus.stats.settle_s
        bus_s, self._bus_seen = bus_total - self._bus_seen, bus_total
        times = StepTimes(wait_s=wait_s, train_s=t_train, publish_s=t_pub, checkpoint_s=t_ckpt, bus_s=bus_s)
        point = step_point(
            self.state.step,
            groups,
            res,
            times,
            checkpointed=checkpointed,
            dropped_zero_variance=self.dropped_zero_var,
            ledger=read_ledger(self.r, self.rec.id),
        )
        st = self.src.stats
        point["backlog_groups"] = sum(isinstance(e, SegmentRef) for e, _ in items)  # of this batch, from segments
        point["backlog_segments_read"] = st.segments_read
        point["backlog_segments_refused"] = st.segments_refused
        point["backlog_wait_s"] = round(st.wait_s, 3)
        self.session.trained(point)
        record_point(self.r, self.rec.id, "trainer", point)
        log.info(
            "job %s step %d/%d: reward %.3f loss %.4f mismatch_kl %.4f is_frac %.3f stale %s "
            "(wait %.1fs train %.2fs publish %.2fs ckpt %.2fs)",
            self.rec.id,
            self.state.step,
            self.rec.spec.steps,
            point["reward_mean"],
            point["loss"],
            res.stats.get("mismatch_kl", 0.0),
            res.stats.get("is_frac", 0.0),
            point["staleness_hist"],
            wait_s,
            t_train,
            t_pub,
            t_ckpt,
        )

    # -- checkpoints -------------------------------------------------------------------
    def _checkpoint(self, files: dict[str, bytes] | None = None, *, ack: bool = True) -> float:
        """Store the full state (files first, manifest last); returns the seconds it took."""
        t0 = time.time()
        files = files if files is not None else self._policy_files()
        self.state.trained_groups = [gid for _, gid in self.since_ckpt]
        opt_state = None
        if self.sharded:  # full tensors, so any world size (or the one-process path) can resume it
            self._collective(CMD_OPTIMIZER)
            opt_state = full_optimizer_tensors(self.learner.opt)
        save_checkpoint(
            self.store,
            self.rec.id,
            self.state,
            files,
            self.learner.opt,
            self.learner.sched,
            epoch=self._epoch(),
            before_manifest=self._assert_lease,
            opt_state=opt_state,
        )
        dt = time.time() - t0
        self.save_times.append(dt)
        if dt > self.s.grace_s:
            log.warning("checkpoint took %.1fs, longer than the %.0fs pre-emption grace period", dt, self.s.grace_s)
        if ack:
            self._ack_checkpointed()
        try:
            kept = prune_checkpoints(self.store, self.rec.id, self.s.keep_checkpoints)
            prune_versions(
                self.store,
                self.r,
                self.rec.id,
                Retention(self.s.keep_versions, self.s.keep_versions_every),
                checkpoint_steps=kept,
            )
        except Exception as e:  # old checkpoints and versions are clutter, not a correctness problem
            log.warning("could not prune old checkpoints or versions: %s", e)
        return dt

    def _ack_checkpointed(self) -> None:
        entries = [e for e, _ in self.since_ckpt]
        if entries:
            self._ack(entries, "trained")
        self.ckpt_groups = {gid for _, gid in self.since_ckpt}
        self.since_ckpt = []

    def _checkpoint_if_dirty(self) -> None:
        """At exit: whatever was trained since the last checkpoint goes to the store now."""
        if self.since_ckpt and self.comm.is_main:
            dt = self._checkpoint()
            log.info("job %s: exit checkpoint at step %d (%.2fs)", self.rec.id, self.state.step, dt)

    def _published_at(self, version: int) -> float | None:
        """When version's manifest was written (None: not published, or unreadable)."""
        if version <= 0:
            return None
        try:
            return read_manifest(self.store, self.rec.id, version).created_at
        except (StoreError, ValueError, TypeError):
            return None

    def _epoch(self) -> int:
        return self.lease.epoch if self.lease is not None else 0

    # -- publishing ------------------------------------------------------------------
    def _publish(self, files: dict[str, bytes]) -> None:
        self._collective(CMD_PROBE)
        probe = compute_probe(self.model, self.tok, self.rec.spec.task, self.s.logits_chunk)
        if at := self.publisher.publish(self.state.step, files, probe):
            self.progress.published(self.state.step, at)

    def _publish_if_missing(self) -> None:
        if not self.publisher.exists(self.state.step):
            self._publish(self._policy_files())
        self._advance_pointer()

    def _advance_pointer(self) -> None:
        self.publisher.announce(self.state.step)
        self.rt.gauges["policy_versions"] = {self.rec.id: self.state.step}
