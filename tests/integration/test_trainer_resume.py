"""Checkpoint and resume of the trainer against a real Redis and a file:// store (CPU, deterministic).

Each scenario interrupts a run (an exception injected mid-step, a crash between storing a
checkpoint and acknowledging it, a SIGTERM-style stop, a spent time budget), resumes with a
fresh JobTrainer from the store and the bus, and must end with exactly the weights, LR
and ledger of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from services.cli.launch import free_port
from services.trainer.checkpoint import checkpoint_steps, load_checkpoint
from services.trainer.loop import JobTrainer
from services.trainer.policy import ADAPTER_WEIGHTS
from shared import keys
from shared.bus import FIELD, Bus
from shared.folders import get_folder, put_folder
from shared.job import JobState, load_job
from shared.lease import Lease
from shared.metrics import read_ledger, read_points
from shared.policy import version_prefix
from shared.schema import encode
from tests.support.trainer_resume import (
    BATCH,
    JOB,
    STEPS,
    ZERO_VAR,
    Run,
    crash_before_ack,
    crash_before_publish,
    resume_groups,
)
from tests.support.waits import Deadline


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shared.ml.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, seed=0)


def _after_step(monkeypatch, fn) -> None:  # noqa: ANN001
    """Call fn(trainer) right after each step's metrics are recorded."""
    orig = JobTrainer._record

    def hooked(self, *a, **k):  # noqa: ANN001, ANN202
        orig(self, *a, **k)
        fn(self)

    monkeypatch.setattr(JobTrainer, "_record", hooked)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir, redis_server):  # noqa: ANN001, ANN201
    """The uninterrupted run: final adapter and LR."""
    client = redis_server.client()
    run = Run(client, tmp_path_factory.mktemp("ref"), model_dir, checkpoint_every=2)
    t = run.trainer()
    t.run()
    out = run.final()
    ledger = read_ledger(client, JOB)
    points = read_points(client, JOB, "trainer")
    client.close()
    assert [p["step"] for p in points] == list(range(1, STEPS + 1))
    assert ledger["trained"] == STEPS * BATCH and ledger["dropped_zero_variance"] == len(ZERO_VAR)
    assert ledger["in_flight"] == 0
    # Checkpoints are pruned to the newest two; each holds only its interval's groups.
    assert checkpoint_steps(run.store, JOB) == [4, 5]
    assert len(load_checkpoint(run.store, JOB, 5).state.trained_groups) == BATCH
    return out


def _same(got: tuple[dict[str, torch.Tensor], float], want: tuple[dict[str, torch.Tensor], float]) -> None:
    (a, lr_a), (b, lr_b) = got, want
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit-identical on CPU
    assert lr_a == pytest.approx(lr_b)  # the scheduler neither skipped nor double-stepped


def _ledger_balanced(r) -> None:  # noqa: ANN001
    led = read_ledger(r, JOB)
    assert led["trained"] == STEPS * BATCH, led
    assert led["dropped_zero_variance"] == len(ZERO_VAR), led
    assert led["in_flight"] == 0, led
    assert r.xpending(keys.ready(JOB), keys.GROUP_TRAINER)["pending"] == 0


def test_crash_mid_interval_then_resume_gives_the_same_weights(r, tmp_path, model_dir, reference, monkeypatch):
    run = Run(r, tmp_path, model_dir, checkpoint_every=2)
    crash_before_publish(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="injected"):
        run.trainer().run()
    assert checkpoint_steps(run.store, JOB) == [2]
    monkeypatch.undo()
    t = run.trainer()
    assert t.state.step == 2 and t.learner.sched.last_epoch == 2
    t.run()
    _same(run.final(), reference)
    _ledger_balanced(r)


def test_crash_between_checkpoint_and_ack_counts_each_group_once(r, tmp_path, model_dir, reference, monkeypatch):
    run = Run(r, tmp_path, model_dir, checkpoint_every=2)
    crash_before_ack(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="injected"):
        run.trainer().run()
    monkeypatch.undo()
    t = run.trainer()
    assert t.state.step == 4 and len(t.ckpt_groups) == 2 * BATCH  # the interval 3..4 may come back
    t.run()
    _same(run.final(), reference)
    _ledger_balanced(r)  # the redelivered groups were acked as trained, not trained again


def test_stop_signal_checkpoints_at_exit_and_resume_runs_the_rest(r, tmp_path, model_dir, reference, monkeypatch):
    run = Run(r, tmp_path, model_dir, checkpoint_every=10)  # only the exit checkpoint saves step 2
    _after_step(monkeypatch, lambda t: t.rt.stop.set() if t.state.step == 2 else None)
    t = run.trainer()
    t.run()
    assert t.exit_reason.startswith("stop requested") and checkpoint_steps(run.store, JOB) == [2]
    assert read_ledger(r, JOB)["trained"] == 2 * BATCH  # acked once durable
    monkeypatch.undo()
    run.trainer().run()
    _same(run.final(), reference)
    _ledger_balanced(r)


def test_stop_before_a_batch_is_applied_leaves_it_pending(r, tmp_path, model_dir, reference, monkeypatch):
    run = Run(r, tmp_path, model_dir, checkpoint_every=2)
    # SIGTERM arrives while step 2's batch is being trained: the Learner sees it before its
    # first optimizer step and abandons the batch, which stays pending on the bus.
    orig_step = JobTrainer._step

    def step_with_stop(self, items, wait_s):  # noqa: ANN001, ANN202
        if self.state.step == 1:
            self.rt.stop.set()
        return orig_step(self, items, wait_s)

    monkeypatch.setattr(JobTrainer, "_step", step_with_stop)
    t = run.trainer()
    t.run()
    assert t.state.step == 1 and checkpoint_steps(run.store, JOB) == [1]
    assert "mid-batch" in t.exit_reason
    monkeypatch.undo()
    run.trainer().run()
    _same(run.final(), reference)
    _ledger_balanced(r)


def test_time_budget_exits_with_a_checkpoint_and_the_next_session_finishes(
    r, tmp_path, model_dir, reference, monkeypatch
):
    run = Run(r, tmp_path, model_dir, checkpoint_every=10)

    def spend_budget(t: JobTrainer) -> None:
        if t.state.step == 3:
            t.deadline = time.time() + 0.01  # less than any step + save: leave now
            t.save_times.append(1.0)

    _after_step(monkeypatch, spend_budget)
    t = run.trainer()
    t.run()
    assert t.exit_reason.startswith("time budget") and t.rt.stop.is_set()
    assert checkpoint_steps(run.store, JOB) == [3]
    monkeypatch.undo()
    run.trainer().run()
    _same(run.final(), reference)
    _ledger_balanced(r)


def test_budget_estimate_uses_measured_step_and_save_times(r, tmp_path, model_dir):
    run = Run(r, tmp_path, model_dir, checkpoint_every=2)
    run.settings.time_budget_s = 100.0
    t = run.trainer()
    t.s.budget_margin_s = 2.0
    t.deadline = time.time() + 10.0
    t.step_times.extend([1.0, 4.0])
    t.save_times.append(5.0)
    assert not t._out_of_budget(about_to_step=False)  # a save (5s) + margin fits in 10s
    assert t._out_of_budget(about_to_step=True)  # a 4s step + 5s save + 2s margin does not
    t.s.budget_margin_s = 0.5
    assert not t._out_of_budget(about_to_step=True)
    assert not run.trainer().deadline == 0.0  # --time-budget sets a deadline


def _feed_extra(r, i: int) -> None:  # noqa: ANN001
    """Extra group i (0 or 1, with reward variance): step STEPS+1's batch, past what Run fed."""
    g = resume_groups(STEPS + 1)[STEPS * BATCH + len(ZERO_VAR) + i]
    r.xadd(keys.ready(JOB), {FIELD: encode(g)})
    r.hincrby(keys.ledger(JOB), "fed", 1)


def test_a_drained_backlog_ends_the_session_and_its_partial_batch_waits_for_the_next(r, tmp_path, model_dir):
    run = Run(r, tmp_path, model_dir, checkpoint_every=100, steps=STEPS + 1)
    _feed_extra(r, 0)  # half of step STEPS+1's batch: it cannot form, so the session drains
    run.settings.leave_when_idle_s = 1.0
    t = run.trainer()
    guard = threading.Timer(120, t.rt.stop.set)  # a trainer that never leaves fails, it does not hang
    guard.start()
    try:
        t.run()
    finally:
        guard.cancel()
    assert t.exit_reason.startswith("drained: no batch for") and t.rt.stop.is_set(), t.exit_reason
    assert checkpoint_steps(run.store, JOB) == [STEPS]  # the exit checkpoint, then acks
    led = read_ledger(r, JOB)
    assert led["trained"] == STEPS * BATCH, led
    assert r.xpending(keys.ready(JOB), keys.GROUP_TRAINER)["pending"] == 1  # left for the next session
    assert load_job(r, JOB).state == JobState.running
    _feed_extra(r, 1)  # rollout went on meanwhile: the next burst completes the job
    t = run.trainer()
    t.run()
    assert t.state.step == STEPS + 1 and load_job(r, JOB).state == JobState.completed
    led = read_ledger(r, JOB)
    assert led["trained"] == (STEPS + 1) * BATCH and led["in_flight"] == 0, led
    assert r.xpending(keys.ready(JOB), keys.GROUP_TRAINER)["pending"] == 0


def _trainer_process(  # noqa: ANN001
    run: Run, redis_server, tmp_path: Path, *args: str, env: dict[str, str] | None = None, name: str = "trainer"
) -> tuple[subprocess.Popen, Path]:
    """python -m services.trainer for Run's job (`env` on top of the defaults), logging to
    tmp_path/<name>.log."""
    full = {
        **os.environ,
        "REDIS_URL": redis_server.url,
        "STORE_URL": run.store.url,
        "BURSTRL_DEV": "1",
        "BURSTRL_PORT": str(free_port()),
        "BURSTRL_TRAINER_JOB": JOB,
        "BURSTRL_TRAINER_DEVICE": "cpu",
        "BURSTRL_TRAINER_CHECKPOINT_EVERY": "100",
        "BURSTRL_TRAINER_THREADS": "1",
        **(env or {}),
    }
    root = Path(__file__).resolve().parents[2]
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.trainer", *args], cwd=root, env=full, stdout=out, stderr=subprocess.STDOUT
        )
    return proc, log


def test_sigterm_in_a_real_process_checkpoints_and_exits_0(r, tmp_path, model_dir, redis_server):
    """python -m services.trainer trains what the bus holds, waits for more, gets SIGTERM."""
    run = Run(r, tmp_path, model_dir, checkpoint_every=100, steps=50)  # data for 5 steps only
    proc, log = _trainer_process(run, redis_server, tmp_path)
    try:
        deadline = time.time() + 180
        while len(read_points(r, JOB, "trainer")) < STEPS:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert checkpoint_steps(run.store, JOB) == []  # nothing durable yet: acks wait for a checkpoint
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert time.time() - t0 < 30  # within a typical pre-emption grace period
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert checkpoint_steps(run.store, JOB) == [STEPS]
    led = read_ledger(r, JOB)
    assert led["trained"] == STEPS * BATCH and led["in_flight"] == 0
    assert load_job(r, JOB).state == JobState.running  # pre-empted, not finished: the next session resumes


def test_a_real_trainer_leaves_by_itself_once_the_backlog_is_drained(r, tmp_path, model_dir, redis_server):
    """--leave-when-idle: the process checkpoints and exits 0 on its own; nobody has to stop it."""
    run = Run(r, tmp_path, model_dir, checkpoint_every=100, steps=50)  # data for 5 steps only
    proc, log = _trainer_process(run, redis_server, tmp_path, "--leave-when-idle", "2")
    try:
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert checkpoint_steps(run.store, JOB) == [STEPS]
    assert read_ledger(r, JOB)["trained"] == STEPS * BATCH
    assert "drained: no batch for" in log.read_text()
    assert load_job(r, JOB).state == JobState.running


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "soon"])
def test_leave_when_idle_refuses_what_is_not_seconds(bad: str) -> None:
    from services.trainer.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--leave-when-idle", bad])
    assert parse_args(["--leave-when-idle", "2.5"]).leave_when_idle == 2.5


def test_a_corrupt_version_in_the_way_is_published_again(r, tmp_path, model_dir, reference):
    """A torn or tampered policy/v{N} where the trainer will publish N: replaced, not kept."""
    run = Run(r, tmp_path, model_dir, checkpoint_every=2)
    prefix = version_prefix(JOB, 2)
    put_folder(run.store, prefix, {ADAPTER_WEIGHTS: b"good bytes"}, {"job_id": JOB, "version": 2})
    run.store.put(f"{prefix}/{ADAPTER_WEIGHTS}", b"tampered")  # hash no longer matches
    run.trainer().run()
    meta, files = get_folder(run.store, prefix)  # verifies every hash: would raise if still corrupt
    assert meta["step"] == 2 and files[ADAPTER_WEIGHTS] != b"good bytes"
    _same(run.final(), reference)


# -- one trainer per job: the lease and its fence (docs/architecture.md, invariant 10) ------
def test_a_trainer_stalled_past_its_lease_can_never_publish(r, tmp_path, model_dir, reference, monkeypatch):
    """Trainer A checks its lease before writing v3's manifest, then stalls past its TTL; B takes
    the job over; A's late manifest lands. No reader may use it, A can neither move the pointer
    nor acknowledge, and B ends with exactly the uninterrupted run's weights and ledger."""
    import services.trainer.publishing as loop_mod
    from shared.fence import takeovers_after
    from shared.policy import DeposedWrite, fetch_version, read_manifest, read_pointer

    run = Run(r, tmp_path, model_dir, checkpoint_every=2)
    a = run.trainer()
    assert a.lease is not None and a.lease.epoch == 1
    orig = loop_mod.publish_version
    b_box: list[JobTrainer] = []

    def stalled(store, m, files, *, before_manifest=None, **kw):  # noqa: ANN001, ANN003, ANN202
        if m.version == 3 and m.epoch == 1 and not b_box:

            def check_then_stall() -> None:
                before_manifest()  # A still holds the lease: the check passes ...
                r.delete(keys.trainer_lease(JOB))  # ... then A stalls past its TTL,
                b_box.append(run.trainer())  # and B takes the job over meanwhile.

            return orig(store, m, files, before_manifest=check_then_stall, **kw)
        return orig(store, m, files, before_manifest=before_manifest, **kw)

    monkeypatch.setattr(loop_mod, "publish_version", stalled)
    a.run()
    monkeypatch.setattr(loop_mod, "publish_version", orig)
    assert a.exit_reason == "lost the lease"
    b = b_box[0]
    assert b.lease is not None and b.lease.epoch == 2
    # A's v3 is in the store, but refused by every reader; the pointer never saw it.
    assert read_manifest(run.store, JOB, 3).epoch == 1
    with pytest.raises(DeposedWrite, match="deposed"):
        fetch_version(run.store, JOB, 3, tmp_path / "v3")
    assert read_pointer(r, JOB) == 2
    assert read_ledger(r, JOB)["trained"] == 2 * BATCH  # A's step 3 was never acknowledged
    b.run()
    assert read_manifest(run.store, JOB, 3).epoch == 2  # B published v3 again itself
    for v in range(1, STEPS + 1):
        fetch_version(run.store, JOB, v, tmp_path / f"ok-v{v}")
    assert [t.epoch for t in takeovers_after(run.store, JOB, 0)] == [1, 2]
    _same(run.final(), reference)
    _ledger_balanced(r)


def test_only_the_holder_acknowledges_or_moves_the_pointer(r):
    """Compare-and-set renewal, compare-and-delete release, and fenced writes in Redis."""
    from shared.lease import LeaseLost
    from shared.policy import advance_pointer, read_pointer

    Bus.ensure_groups(r, JOB)
    a = Lease(r, JOB, "a", ttl_s=30)
    b = Lease(r, JOB, "b", ttl_s=30)
    assert a.acquire() and not b.acquire()
    a_fence = a.fence
    r.delete(keys.trainer_lease(JOB))  # A's lease expired
    assert not a.renew()  # renewal cannot bring back a lease another may have taken
    assert b.acquire() and b.epoch == a.epoch + 1
    assert not a.release() and b.held()  # A's release leaves B's lease alone
    with pytest.raises(LeaseLost):
        advance_pointer(r, JOB, 5, a_fence)
    assert advance_pointer(r, JOB, 5, b.fence) and read_pointer(r, JOB) == 5
    assert not advance_pointer(r, JOB, 4, b.fence) and read_pointer(r, JOB) == 5  # never backwards
    r.xadd(keys.ready(JOB), {FIELD: b"x"})
    bus = Bus(r, keys.GROUP_TRAINER, "trainer", redo_own_pending=False)
    entries = bus.read([keys.ready(JOB)], count=1, block_ms=50)
    with pytest.raises(LeaseLost):
        bus.ack(entries, {JOB: {"trained": 1}}, fence=a_fence)
    assert read_ledger(r, JOB).get("trained", 0) == 0
    assert bus.ack(entries, {JOB: {"trained": 1}}, fence=b.fence) == 1


def test_the_lease_survives_a_step_longer_than_its_ttl(r):
    """The keeper renews every ttl/3, so work longer than the TTL does not lose the lease."""
    from shared.lease import LeaseKeeper

    lease = Lease(r, JOB, "slow", ttl_s=1.0)
    assert lease.acquire()
    with LeaseKeeper(lease) as keeper:
        for _ in range(8):  # 2.4 s of "training", 2.4x the TTL
            time.sleep(0.3)
            assert lease.held()
        keeper.check()
    r.delete(keys.trainer_lease(JOB))  # gone (expired, taken): the keeper notices
    keeper2 = LeaseKeeper(lease)
    with keeper2:
        deadline = time.time() + 10
        while not keeper2.lost.is_set() and time.time() < deadline:
            time.sleep(0.05)
    assert keeper2.lost.is_set()


@pytest.mark.slow
def test_sigstopped_trainer_is_deposed_and_the_job_counts_each_group_once(r, tmp_path, model_dir, redis_server):
    """Real processes: trainer A is frozen (SIGSTOP) mid-job past its lease, B takes over and
    trains, A is thawed. A must stop without publishing anything a reader accepts, the lease
    must not bounce, and every group is trained exactly once."""
    from shared.fence import takeovers_after
    from shared.policy import fetch_version, latest_version

    steps = 30
    run = Run(r, tmp_path, model_dir, checkpoint_every=1, steps=steps, data_steps=steps)
    env = {"BURSTRL_TRAINER_CHECKPOINT_EVERY": "1", "BURSTRL_TRAINER_LEASE_S": "5"}
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def start(name: str) -> None:
        procs[name], logs[name] = _trainer_process(
            run, redis_server, tmp_path, env={**env, "BURSTRL_REPLICA": f"trainer-{name}"}, name=f"trainer-{name}"
        )

    def wait(pred, what: str, timeout: float = 240) -> None:  # noqa: ANN001
        deadline = Deadline(timeout)
        while not pred():
            assert all(p.poll() is None for p in procs.values()), {n: lg.read_text()[-2000:] for n, lg in logs.items()}
            assert deadline, f"timed out waiting for {what}: " + logs["a"].read_text()[-2000:]
            time.sleep(0.2)

    try:
        start("a")
        wait(lambda: len(read_points(r, JOB, "trainer")) >= 3, "trainer A's first steps")
        os.kill(procs["a"].pid, signal.SIGSTOP)
        frozen_at = len(read_points(r, JOB, "trainer"))
        start("b")
        wait(lambda: len(read_points(r, JOB, "trainer")) >= frozen_at + 3, "trainer B taking over")
        os.kill(procs["a"].pid, signal.SIGCONT)
        wait(lambda: load_job(r, JOB).state == JobState.completed, "the job to complete", timeout=400)
        wait(lambda: "stopping without writing anything more" in logs["a"].read_text(), "A to see it was deposed", 60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                p.wait(timeout=60)
    assert [t.epoch for t in takeovers_after(run.store, JOB, 0)] == [1, 2]  # no bouncing
    led = read_ledger(r, JOB)
    assert led["trained"] == steps * BATCH and led["in_flight"] == 0, led
    assert latest_version(run.store, JOB) == steps
    from services.trainer.retention import stored_versions

    for v in stored_versions(run.store, JOB):  # every version a reader would adopt is fence-valid
        fetch_version(run.store, JOB, v, tmp_path / f"v{v}")


def test_each_session_reports_its_billable_time_steps_and_lag(r, tmp_path, model_dir):
    """The burst timeline's data: a start and an end point per session, the end with what was trained."""
    run = Run(r, tmp_path, model_dir, checkpoint_every=2)
    run.trainer().run()
    start, end = read_points(r, JOB, "trainer_session")
    assert (start["event"], end["event"]) == ("start", "end")
    assert end["steps"] == STEPS and end["groups"] == STEPS * BATCH and end["first_step"] == 0
    assert end["epoch"] == start["epoch"] == 1
    assert 0 <= end["startup_s"] <= end["billable_s"] and end["lag_mean"] >= 0
    assert sum(end["lag_hist"].values()) == STEPS * BATCH
