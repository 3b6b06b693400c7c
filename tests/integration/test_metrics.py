"""Metric points: what the dashboard, the CLI and the trackers read."""

import json

import numpy as np
import pytest

from shared import keys
from shared.metrics import read_points, record_point


def test_points_are_strict_json_even_with_nan_and_numpy(r):
    record_point(r, "m-1", "trainer", {"loss": float("nan"), "kl": np.float32(0.25), "parts": {"correct": 1}})
    raw = r.xrange(keys.metrics("m-1"))[0][1][b"m"]
    # Browsers' JSON.parse rejects NaN; the stored point must be strict JSON.
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    [p] = read_points(r, "m-1", "trainer")
    assert p["loss"] is None and p["kl"] == 0.25 and p["parts"] == {"correct": 1}


def test_a_value_that_is_not_data_is_refused(r):
    with pytest.raises(TypeError, match="not a number"):
        record_point(r, "m-1", "trainer", {"oops": object()})


def _session_point(event: str, epoch: int) -> dict:
    return {"event": event, "epoch": epoch, "replica": f"t-{epoch}"}


def test_a_missing_session_index_is_made_once_from_the_series(r):
    """A job from before the session index: its first read makes the index from the series,
    and no later read scans the series again (a point written to the series alone after that
    is not seen; one recorded as the trainer records it is)."""
    from shared.metrics import read_session_points, record_session_point

    record_point(r, "old-1", "trainer_session", _session_point("start", 1))
    record_point(r, "old-1", "rollout", {"groups": 8})
    assert [p["epoch"] for p in read_session_points(r, "old-1")] == [1]
    assert r.xlen(keys.sessions("old-1")) == 1
    record_point(r, "old-1", "trainer_session", _session_point("end", 1))  # the series only
    assert [p["event"] for p in read_session_points(r, "old-1")] == ["start"]
    record_session_point(r, "old-1", _session_point("end", 1))
    assert [p["event"] for p in read_session_points(r, "old-1")] == ["start", "end"]

    # A job with no session yet: an empty index, made once.
    record_point(r, "new-1", "rollout", {"groups": 8})
    assert read_session_points(r, "new-1") == []
    assert r.exists(keys.sessions("new-1")) and r.xlen(keys.sessions("new-1")) == 0
    record_point(r, "new-1", "trainer_session", _session_point("start", 1))  # the series only
    assert read_session_points(r, "new-1") == []


def test_a_trainer_that_finds_no_index_keeps_the_sessions_before_it(r):
    """The first session point recorded on a job from before the index makes the index from the
    series first, so the earlier sessions are not hidden behind the new one."""
    from shared.metrics import read_session_points, record_session_point

    record_point(r, "old-2", "trainer_session", _session_point("start", 1))
    record_point(r, "old-2", "trainer_session", _session_point("end", 1))
    record_session_point(r, "old-2", _session_point("start", 2), at=123.0)
    got = read_session_points(r, "old-2")
    assert [(p["event"], p["epoch"]) for p in got] == [("start", 1), ("end", 1), ("start", 2)]
    assert got[-1]["at"] == 123.0
    # Each carries its id in the series: the cursor for the steps since.
    assert [p["id"] for p in got] == [p["id"] for p in read_points(r, "old-2", "trainer_session", with_ids=True)]
