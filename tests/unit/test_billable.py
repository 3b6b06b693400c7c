"""services/plan/billable.py: billable-seconds accounting of the burst benchmark (pure functions)."""

from __future__ import annotations

import math

import pytest

from services.plan.billable import accuracy_at, billable_at, session_intervals, time_to, union, windows_billable


def test_union_merges_overlaps_and_drops_empty() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (4, 4), (7, 8)]) == [(0, 3), (5, 8)]


def test_billable_counts_a_replica_beside_the_trainer_once() -> None:
    trainer, replica = (10.0, 40.0), (15.0, 45.0)
    assert billable_at(100, [trainer, replica]) == 35.0
    assert billable_at(20, [trainer, replica]) == 10.0
    assert billable_at(5, [trainer]) == 0.0
    assert billable_at(100, [(0, 10), (50, 60)]) == 20.0


def test_session_intervals_from_end_points() -> None:
    pts = [
        {"event": "start", "process_start": 100.0, "billable_s": 3.0},
        {"event": "end", "process_start": 100.0, "billable_s": 30.5},
        {"event": "end", "process_start": 200.0, "billable_s": 10.0},
    ]
    assert session_intervals(pts) == [(100.0, 130.5), (200.0, 210.0)]


def test_time_to_and_accuracy_at() -> None:
    evals = [{"t": 0, "accuracy": 0.2}, {"t": 30, "accuracy": 0.4}, {"t": 10, "accuracy": 0.5}]
    assert time_to(evals, 0.45) == 10
    assert time_to(evals, 0.6) is None
    assert accuracy_at(evals, 20) == 0.5
    assert accuracy_at(evals, 30) == 0.4
    assert accuracy_at(evals, -1) is None


def test_windows_billable_pays_startup_per_window() -> None:
    assert windows_billable(0, 10, 30) == 10  # the first window's start-up
    assert windows_billable(20, 10, 30) == 30  # one window: 10 + 20
    assert windows_billable(21, 10, 30) == 41  # two windows
    assert windows_billable(5, 30, 30) == math.inf
    with pytest.raises(ValueError, match="window_s"):
        windows_billable(1, 1, 0)
