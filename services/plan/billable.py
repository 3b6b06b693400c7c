"""Billable-seconds accounting, pure functions of alive intervals and evaluations (bench/burst.py
measures with them).

A rented card is billed while a process on it is alive: the trainer's, and a burst-side rollout
replica's if there is one. Two processes on the same card bill once, so the billed seconds are
those of the union of their alive intervals (services/plan/bursts.py counts it the same way).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same seconds (empty ones dropped)."""
    out: list[Interval] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def billable_at(t: float, intervals: Iterable[Interval]) -> float:
    """Seconds billed up to time t: the part of the intervals' union before t."""
    return sum(max(0.0, min(b, t) - a) for a, b in union(intervals) if a < t)


def session_intervals(points: Iterable[dict[str, Any]]) -> list[Interval]:
    """Alive intervals from the trainer's "trainer_session" end points: process start to leaving
    the job (`billable_s` is the process's age at that point)."""
    return [
        (float(p["process_start"]), float(p["process_start"]) + float(p["billable_s"]))
        for p in points
        if p.get("event") == "end"
    ]


def time_to(evals: list[dict[str, Any]], threshold: float, key: str = "t") -> float | None:
    """`key` of the first evaluation (in `key` order) whose accuracy reaches the threshold; None: never."""
    for e in sorted(evals, key=lambda e: e[key]):
        if e["accuracy"] >= threshold:
            return float(e[key])
    return None


def accuracy_at(evals: list[dict[str, Any]], budget: float, key: str = "t") -> float | None:
    """Accuracy of the last evaluation made within the budget (`key` <= budget); None: none was."""
    within = [e for e in evals if e[key] <= budget]
    return max(within, key=lambda e: e[key])["accuracy"] if within else None


def windows_billable(train_s: float, startup_s: float, window_s: float) -> float:
    """Billed seconds of a trainer that must restart in every burst window to train `train_s` seconds:
    each window pays `startup_s` before its training, so ceil(train_s / (window - startup)) windows
    (at least one). Infinite when a window is too short to train at all."""
    if train_s < 0 or startup_s < 0 or window_s <= 0:
        raise ValueError(f"need train_s >= 0, startup_s >= 0, window_s > 0; got {train_s}, {startup_s}, {window_s}")
    room = window_s - startup_s
    if room <= 0:
        return math.inf
    windows = max(1, math.ceil(train_s / room - 1e-9))
    return windows * startup_s + train_s
