"""The trainer and the feeder's in-flight window, against a real Redis, the real feeder and the real
trainer (in this process, and as processes): every combination of checkpoint cadence, staleness
and backlog finishes, and a trainer that waits says what holds it up.

Before: a job with max_staleness 1 and checkpoint_every 4 stopped after step 2 for good (fed 8,
trained 0), every readiness check green. The groups trained since the last checkpoint stay
unacknowledged until it is stored (invariant 2), so they count in flight and filled the
window (invariant 4): the batch that would have reached the checkpoint never came.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from services.api.jobs import create_job
from services.cli.launch import free_port
from services.trainer.claim import claim_job
from services.trainer.loop import JobTrainer
from services.trainer.progress import PROGRESS_CHECK
from services.trainer.settings import TrainerSettings
from shared import keys
from shared.backlog import held_back
from shared.job import JobRecord, JobSpec, JobState, load_job
from shared.ledger import audit
from shared.metrics import read_ledger
from shared.store import FileStore
from tests.support.backlog import fake_rt, group, push_ready
from tests.support.jobs import fresh_tiny_model, small_spec
from tests.support.launched import service_launcher
from tests.support.stack import readyz, wait_for
from tests.support.waits import Deadline
from tests.support.window import FeedLoop, Sampler, completed, sample_until, stop_all

STEPS, BATCH, G = 4, 2, 2
TOKEN = "window-test-token-0123456789"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_tiny_model(tmp_path_factory)


def _spec(model_dir: Path, *, staleness: int, backlog: bool, steps: int = STEPS, batch: int = BATCH) -> JobSpec:
    return small_spec(
        model_dir,
        name="win",
        group=G,
        batch=batch,
        steps=steps,
        max_staleness=staleness,
        eval_size=0,
        # A backlog as small as a batch: its budget fills as the window does.
        backlog={"max_groups": batch, "segment_groups": batch} if backlog else {},
    )


def _trainer(r, store, rec: JobRecord, **settings: object) -> JobTrainer:  # noqa: ANN001
    rt = fake_rt(r)
    s = TrainerSettings(job=rec.id, device="cpu", budget_margin_s=0, dev=True, **settings)
    claimed = claim_job(rt, s, store)  # type: ignore[arg-type]
    assert claimed is not None
    rec, lease = claimed
    return JobTrainer(rt, s, store, rec, lease=lease)  # type: ignore[arg-type]


def _stop_after(t: JobTrainer, r, job_id: str, timeout: float) -> threading.Thread:  # noqa: ANN001
    """A watchdog: stops the trainer once `timeout` idle-machine seconds pass without the job completing."""

    def watch() -> None:
        deadline = Deadline(timeout)
        while deadline and not t.rt.stop.is_set():
            if (rec := load_job(r, job_id)) is not None and rec.state == JobState.completed:
                return
            time.sleep(0.2)
        t.rt.stop.set()

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    return th


@pytest.mark.parametrize("backlog", [False, True], ids=["windowed", "backlog"])
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("every", [1, 4])
def test_every_checkpoint_cadence_finishes_the_job(r, tmp_path, model_dir, every, staleness, backlog):
    """checkpoint_every x max_staleness x backlog: each job completes within the bound."""
    store = FileStore(tmp_path / "store")
    rec = create_job(r, spec=_spec(model_dir, staleness=staleness, backlog=backlog))
    threads = FeedLoop(r, store), Sampler(r, rec.id, g=G)
    for th in threads:
        th.start()
    t = _trainer(r, store, rec, checkpoint_every=every)
    _stop_after(t, r, rec.id, 120)
    try:
        t.run()
    finally:
        t.rt.stop.set()  # the watchdog too
        stop_all(*threads)
    led = read_ledger(r, rec.id)
    assert t.state.step == STEPS, f"stalled at step {t.state.step}: {t.exit_reason}; ledger {led}"
    assert load_job(r, rec.id).state == JobState.completed
    assert led["trained"] == STEPS * BATCH and led.get("dead", 0) == 0, led
    a = audit(r, rec.id)
    assert a.balanced, a.problems


def test_the_rule_holds_back_exactly_when_the_window_is_full_of_trained_groups(r, model_dir):
    """shared.backlog.held_back: room in the window, or a batch of untrained groups in flight, and
    the next batch can come; neither, and only the trainer's checkpoint frees the window."""
    rec = create_job(r, spec=_spec(model_dir, staleness=1, backlog=False))  # window 4, batch 2
    led = {"fed": 4, "in_flight": 4}
    assert held_back(r, rec, led, trained_unacked=2) == ""  # 2 untrained: a batch
    why = held_back(r, rec, led, trained_unacked=4)
    assert "in-flight window full" in why and "4 of the 4 groups in flight are trained" in why, why
    assert held_back(r, rec, {"fed": 3, "in_flight": 3}, trained_unacked=3) == ""  # room for one more
    bl = create_job(r, spec=_spec(model_dir, staleness=1, backlog=True))  # room: window 4 + backlog 2
    assert held_back(r, bl, {"fed": 6, "in_flight": 6}, trained_unacked=4) == ""
    assert "group budget" in held_back(r, bl, {"fed": 6, "in_flight": 6}, trained_unacked=6)


def test_a_waiting_trainer_says_what_holds_the_batch_up(r, tmp_path, model_dir):
    """No rollout: the feeder fills the window and nothing comes back. The trainer's `progress`
    check turns degraded with the reason within the bound, and clears once a batch trains."""
    store = FileStore(tmp_path / "store")
    rec = create_job(r, spec=_spec(model_dir, staleness=1, backlog=False, steps=1))
    feed = FeedLoop(r, store)
    feed.start()
    t = _trainer(r, store, rec, wait_report_s=1)
    worker = threading.Thread(target=t.run, daemon=True)
    worker.start()
    sampler = Sampler(r, rec.id, g=G)
    try:

        def check() -> dict:
            return t.rt.health.snapshot()[1].get(PROGRESS_CHECK, {})

        got = wait_for(lambda: check() if check().get("ok") is False else None, 60, "the progress check to turn")
        assert f"job {rec.id}: no batch for" in got["reason"] and "4 more in flight" in got["reason"], got
        assert "still in rollout, reward or ref" in got["reason"] and got["scope"] == "job", got
        assert t.rt.health.snapshot()[0]  # degraded, not unready: the trainer itself is fine
        sampler.start()
        worker.join(timeout=120)
        assert not worker.is_alive() and t.state.step == 1
        assert check()["ok"] is True
    finally:
        t.rt.stop.set()
        stop_all(feed, sampler)
        worker.join(timeout=30)


def test_a_partial_batch_held_past_claim_idle_is_neither_dead_lettered_nor_counted_twice(r, tmp_path, model_dir):
    """The trainer holds 2 of a batch of 4 for 7 reclaim passes past claim_idle (time-scaled:
    0.2 s; 5 deliveries make an entry poison), then the rest comes. Before, each reclaim pass claimed its own entries from itself, and at 5
    deliveries it dead-lettered them, then trained them anyway: dead 2 and trained 2 of the same."""
    store = FileStore(tmp_path / "store")
    rec = create_job(r, spec=_spec(model_dir, staleness=4, backlog=False, steps=1, batch=4))
    push_ready(r, rec.id, [group(rec.id, i, g=G) for i in range(2)])
    t = _trainer(r, store, rec, claim_idle_s=0.2)
    worker = threading.Thread(target=t.run, daemon=True)
    worker.start()
    try:
        passes, deadline = {t.bus._last_claim}, Deadline(60)
        while len(passes) < 8 and deadline:  # reclaim passes past claim_idle, the batch half full
            passes.add(t.bus._last_claim)
            time.sleep(0.05)
        assert len(passes) >= 8, "the trainer's bus made no reclaim passes"
        push_ready(r, rec.id, [group(rec.id, i, g=G) for i in range(2, 4)])
        worker.join(timeout=120)
        assert not worker.is_alive() and t.state.step == 1
    finally:
        t.rt.stop.set()
        worker.join(timeout=30)
    led = read_ledger(r, rec.id)
    assert led.get("dead", 0) == 0 and r.xlen(keys.dead_letter(rec.id)) == 0, led
    assert led["trained"] == 4 and led["in_flight"] == 0, led
    assert audit(r, rec.id).balanced


@pytest.mark.slow
def test_the_issue_settings_finish_with_the_api_and_the_trainer_as_processes(r, tmp_path, model_dir, redis_server):
    """max_staleness 1, BURSTRL_TRAINER_CHECKPOINT_EVERY=4: the api's feeder and a trainer
    process, as deployed; before, fed 8, trained 0 after step 2 until the bound."""
    api_port, trainer_port = free_port(), free_port()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with service_launcher(tmp_path, redis_server.url, TOKEN) as (launcher, env):
        launcher.start_service("api", env, port=api_port)
        launcher.start_service(
            "trainer",
            {**env, "BURSTRL_TRAINER_CHECKPOINT_EVERY": "4", "BURSTRL_TRAINER_DEVICE": "cpu"},
            port=trainer_port,
        )
        launcher.wait_ready(["api", "trainer"], timeout=180)
        body = _spec(model_dir, staleness=1, backlog=False, steps=6).model_dump(mode="json")
        resp = httpx.post(f"http://127.0.0.1:{api_port}/v1/jobs", json=body, headers=headers, timeout=30)
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["id"]
        sample_until(r, job_id, G, completed(r, job_id), 240, f"job {job_id} to complete", launcher)
        code, ready = readyz(trainer_port)
        assert code == 200, ready
    led = read_ledger(r, job_id)
    assert led["trained"] == 6 * BATCH and led.get("dead", 0) == 0, led
    assert audit(r, job_id).balanced


def test_the_jobs_status_carries_what_its_trainer_says_holds_it_up(r, model_dir):
    """GET /v1/jobs/{id}'s warnings: the `progress` reason a trainer's heartbeat carries for the job."""
    from services.api.jobs import job_status
    from shared.schema import Heartbeat, encode_heartbeat

    rec = create_job(r, spec=_spec(model_dir, staleness=1, backlog=False))
    why = f"job {rec.id}: no batch for 61s: 0 of 2 groups held, 4 trained awaiting a checkpoint, 0 more in flight"
    for replica, reason in (("t1", why), ("t2", "job other-1: no batch for 70s")):
        beat = Heartbeat(
            role="trainer",
            replica=replica,
            host="h",
            port=1,
            version="v",
            ready=True,
            reasons={"progress": reason},
            at=time.time(),
        )
        r.set(keys.service("trainer", replica), encode_heartbeat(beat), ex=30)
    assert f"trainer t1: {why}" in job_status(r, job_id=rec.id)["warnings"]
    assert not any("other-1" in w for w in job_status(r, job_id=rec.id)["warnings"])
