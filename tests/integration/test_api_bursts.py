"""GET /v1/jobs/{id}/bursts: the burst timeline from the trainer's session points, over a real Redis."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from services.trainer.step_report import Session
from shared import keys
from shared.lease import Lease
from shared.metrics import record_point, record_session_point
from tests.support.api import api_client

TOKEN = "s3cr3t-token-for-tests-0123"


@pytest.fixture
def client(r, redis_server):
    with api_client(redis_server.url, TOKEN) as c:
        yield c


def _step(r, job_id: str, step: int, lag: int, groups: int = 4) -> dict:
    point = {"step": step, "groups": groups, "staleness_mean": float(lag), "staleness_hist": {str(lag): groups}}
    record_point(r, job_id, "trainer", point)
    return point


def _session(
    r, job_id: str, epoch: int, *, lags: list[int], end: bool, first_step: int, indexed: bool = True
) -> Session:
    """What services/trainer/loop.py writes: a start point, step points, and (unless killed) an
    end point. `indexed=False`: as a trainer from before the session index wrote them."""
    record = (
        (lambda p: record_session_point(r, job_id, p))
        if indexed
        else (lambda p: record_point(r, job_id, "trainer_session", p))
    )
    s = Session(process_start=time.time() - 30, epoch=epoch, replica=f"h200-{epoch}", step=first_step)
    record(s.point("start"))
    for i, lag in enumerate(lags):
        s.trained(_step(r, job_id, first_step + i + 1, lag))
    if end:
        record(s.point("end", reason="time budget: 0 s left"))
    return s


def _job(client) -> str:
    return client.post("/v1/jobs", json={"base_model": "m", "batch_size": 4}).json()["id"]


def test_the_timeline_shows_each_session_its_billable_seconds_steps_and_lag(client, r):
    job_id = _job(client)
    epochs = []
    for i in range(4):  # four sessions, one after the other: epochs 1..4; the last one holds the lease
        lease = Lease(r, job_id, f"trainer-{i}", 60)
        assert lease.acquire()
        epochs.append(lease.epoch)
        if i < 3:
            lease.release()
    _session(r, job_id, epochs[0], lags=[0, 1, 1], end=True, first_step=0)
    _session(r, job_id, epochs[1], lags=[8, 3], end=True, first_step=3)
    _session(r, job_id, epochs[2], lags=[2], end=False, first_step=5)  # killed: no end point
    _session(r, job_id, epochs[3], lags=[1, 0], end=False, first_step=6)  # training

    got = client.get(f"/v1/jobs/{job_id}/bursts").json()
    a, b, lost, now = got["sessions"]
    assert [s["epoch"] for s in got["sessions"]] == [1, 2, 3, 4]
    assert [s["status"] for s in got["sessions"]] == ["ended", "ended", "lost", "training"]
    assert (a["steps"], a["groups"], a["lag_hist"], a["lag_max"]) == (3, 12, {"0": 4, "1": 8}, 1)
    assert a["lag_mean"] == pytest.approx(2 / 3, abs=1e-3)
    assert a["billable_s"] >= 30 and a["ended_at"] + 0.01 >= a["claimed_at"] >= a["process_start"]  # (rounded to ms)
    assert a["reason"].startswith("time budget") and a["first_step"] == 0 and a["replica"] == "h200-1"
    assert (b["steps"], b["lag_max"], b["lag_mean"]) == (2, 8, 5.5)
    # A trainer killed without a word: billable seconds unknown, never guessed.
    assert lost["billable_s"] is None and lost["steps"] is None and lost["ended_at"] is None
    # The session in progress: billable so far, and steps and lag from its step points.
    assert now["billable_s"] >= 30 and now["ended_at"] is None
    assert (now["steps"], now["groups"], now["lag_hist"], now["lag_max"]) == (2, 8, {"0": 4, "1": 4}, 1)
    totals = got["totals"]
    assert totals["sessions"] == 4 and totals["lost"] == 1 and totals["steps"] == 3 + 2 + 2
    assert totals["billable_s"] == pytest.approx(a["billable_s"] + b["billable_s"] + now["billable_s"], abs=1)
    assert got["truncated"] is False

    newest = client.get(f"/v1/jobs/{job_id}/bursts", params={"limit": 1}).json()
    assert [s["epoch"] for s in newest["sessions"]] == [4] and newest["truncated"] is True


def _epochs(r, job_id: str, n: int) -> list[int]:
    """n sessions' lease epochs, one after another; the lease is left free."""
    out = []
    for i in range(n):
        lease = Lease(r, job_id, f"trainer-{i}", 60)
        assert lease.acquire()
        out.append(lease.epoch)
        lease.release()
    return out


def test_the_timeline_reads_the_session_index_not_the_whole_series(client, r):
    """The ended sessions come from the index alone: with the series gone (say trimmed past
    MAX_POINTS by a long job's step points) they are all still there."""
    job_id = _job(client)
    epochs = _epochs(r, job_id, 3)
    for e, lags in zip(epochs, ([0, 1], [4], [2, 2, 2]), strict=True):
        _session(r, job_id, e, lags=lags, end=True, first_step=0)
    r.delete(keys.metrics(job_id))
    got = client.get(f"/v1/jobs/{job_id}/bursts").json()
    assert [(s["epoch"], s["status"], s["steps"]) for s in got["sessions"]] == [
        (epochs[0], "ended", 2),
        (epochs[1], "ended", 1),
        (epochs[2], "ended", 3),
    ]
    assert r.xlen(keys.sessions(job_id)) == 6


def test_a_job_from_before_the_session_index_still_has_its_timeline(client, r):
    job_id = _job(client)
    e1, e2 = _epochs(r, job_id, 2)
    _session(r, job_id, e1, lags=[1, 1], end=True, first_step=0, indexed=False)
    _session(r, job_id, e2, lags=[3], end=True, first_step=2, indexed=False)
    assert not r.exists(keys.sessions(job_id))
    got = client.get(f"/v1/jobs/{job_id}/bursts").json()
    assert [(s["epoch"], s["steps"], s["lag_max"]) for s in got["sessions"]] == [(e1, 2, 1), (e2, 1, 3)]


def test_a_job_without_sessions_has_an_empty_timeline_and_foreign_points_are_skipped(client, r):
    job_id = _job(client)
    record_point(r, job_id, "trainer_session", {"event": "start", "epoch": "one"})  # not ours
    record_point(r, job_id, "trainer_session", {"event": "paused", "epoch": 7})
    got = client.get(f"/v1/jobs/{job_id}/bursts").json()
    assert got["sessions"] == [] and got["totals"]["billable_s"] == 0 and got["totals"]["sessions"] == 0


@pytest.mark.parametrize("limit", ["0", "-1", "1001", "many", "1.5"])
def test_a_bad_limit_is_a_422_naming_it(client, limit):
    job_id = _job(client)
    resp = client.get(f"/v1/jobs/{job_id}/bursts", params={"limit": limit})
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["query", "limit"]


def test_an_unknown_job_is_a_404_and_the_token_is_required(client):
    assert client.get("/v1/jobs/nope/bursts").status_code == 404
    assert TestClient(client.app).get("/v1/jobs/nope/bursts").status_code == 401
