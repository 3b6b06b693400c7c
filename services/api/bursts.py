"""The burst timeline of a job: when a trainer held it, the rented seconds that cost, the steps
it trained and the lag of the data it trained on.

Built from the trainer's "trainer_session" points (services/trainer/step_report.py): one at
the start of a session (the job leased) and one at its end, both carrying the session's
fencing epoch, which is unique per session (docs/architecture.md, invariant 10). They are read
from the job's session index (`keys.sessions`), so a call costs O(sessions), not a scan of the
job's whole metrics series. A session is
- `ended`: its end point is there; its numbers are the end point's (billable seconds from the
  process start to leaving the job, start-up and model load included);
- `training`: no end point yet and its epoch still holds the lease: billable so far is now
  minus the process start, and its steps and lag so far come from its step points;
- `lost`: no end point and the lease has moved on (a trainer killed without a word): its
  billable seconds are unknown, and are not added up.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from shared import keys
from shared.metrics import read_points, read_session_points

MAX_SESSIONS = 1000  # per answer: a week of hourly bursts is 168


def _lease_epoch(r: redis.Redis, job_id: str) -> int:
    """The epoch of the lease held on the job now (0: none). The value is "{token} {epoch}"."""
    raw = r.get(keys.trainer_lease(job_id))
    try:
        return int(raw.split()[-1]) if raw else 0
    except ValueError:
        return 0


def _lag_max(hist: dict[str, Any]) -> int | None:
    lags = [int(k) for k, n in hist.items() if n]
    return max(lags) if lags else None


def _so_far(r: redis.Redis, job_id: str, after: str) -> dict[str, Any]:
    """Steps, groups and lag of the step points since a session's start point."""
    steps = read_points(r, job_id, "trainer", after=after)
    groups = sum(int(p.get("groups") or 0) for p in steps)
    hist: dict[str, int] = {}
    lag_sum = 0.0
    for p in steps:
        for k, n in (p.get("staleness_hist") or {}).items():
            hist[k] = hist.get(k, 0) + int(n)
        lag_sum += float(p.get("staleness_mean") or 0.0) * int(p.get("groups") or 0)
    return {
        "steps": len(steps),
        "groups": groups,
        "lag_mean": round(lag_sum / groups, 3) if groups else None,
        "lag_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
    }


def _session(start: dict[str, Any] | None, end: dict[str, Any] | None) -> dict[str, Any]:
    p = end or start or {}
    hist = p.get("lag_hist") or {}
    return {
        "epoch": int(p.get("epoch") or 0),
        "replica": str(p.get("replica") or ""),
        "process_start": p.get("process_start"),
        "claimed_at": p.get("claimed_at"),
        "ended_at": end.get("at") if end else None,
        "startup_s": p.get("startup_s"),
        "billable_s": end.get("billable_s") if end else None,
        "first_step": p.get("first_step"),
        "steps": end.get("steps") if end else None,
        "groups": end.get("groups") if end else None,
        "lag_mean": end.get("lag_mean") if end else None,
        "lag_hist": hist if end else {},
        "lag_max": _lag_max(hist) if end else None,
        "reason": str(end.get("reason") or "") if end else "",
        "status": "ended" if end else "lost",
    }


def burst_timeline(r: redis.Redis, *, job_id: str, limit: int) -> dict[str, Any]:
    """The job's last `limit` sessions, oldest first, with totals over them."""
    starts: dict[int, dict[str, Any]] = {}
    ends: dict[int, dict[str, Any]] = {}
    for p in read_session_points(r, job_id):
        epoch, event = p.get("epoch"), p.get("event")
        if not isinstance(epoch, int) or event not in ("start", "end"):  # not a session point we know
            continue
        (ends if event == "end" else starts).setdefault(epoch, p)
    epochs = sorted(set(starts) | set(ends))
    truncated = len(epochs) > limit
    held = _lease_epoch(r, job_id)
    now = time.time()
    sessions = []
    for epoch in epochs[-limit:]:
        s = _session(starts.get(epoch), ends.get(epoch))
        if s["status"] == "lost" and epoch == held:
            s["status"] = "training"
            if isinstance(s["process_start"], int | float):
                s["billable_s"] = round(now - s["process_start"], 3)
            so_far = _so_far(r, job_id, starts[epoch]["id"])
            s.update(so_far, lag_max=_lag_max(so_far["lag_hist"]))
        sessions.append(s)
    known = [s for s in sessions if isinstance(s["billable_s"], int | float)]
    return {
        "job_id": job_id,
        "sessions": sessions,
        "truncated": truncated,  # older sessions left out (`limit`)
        "totals": {
            "sessions": len(sessions),
            "billable_s": round(sum(s["billable_s"] for s in known), 3),
            "steps": sum(int(s["steps"] or 0) for s in sessions),
            "groups": sum(int(s["groups"] or 0) for s in sessions),
            "lost": sum(s["status"] == "lost" for s in sessions),  # billable seconds unknown
        },
    }
