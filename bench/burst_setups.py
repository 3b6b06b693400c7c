"""The setups bench/burst.py runs and its report reads: the job every setup starts from, what each
setup changes, and the labels the page uses. One place, so a new setup joins the runs, rates,
targets and readings that apply to it."""

from __future__ import annotations

from typing import Any

from tests.support.lab.jobs import BACKLOG, BURST_JOB

# The job every setup starts from: the demo's shape without KL, never completing within a run,
# evaluated afterwards off every clock (tests/support/lab/jobs.py).
JOB: dict[str, Any] = BURST_JOB
TASK, LR, SEED = JOB["task"], JOB["learning_rate"], JOB["seed"]
STALENESS_LIMIT = 16
SETUPS: dict[str, dict[str, Any]] = {
    "windowed": {},
    "tis": {"backlog": BACKLOG, "algorithm": {"mismatch": "token_truncate"}},
    "m2po": {"backlog": BACKLOG, "algorithm": {"mismatch": "m2po"}},
    # The staleness limit a user would set from the lag table: M2PO learned as on-policy did up to a lag
    # of ~15 versions there (0.469 vs 0.492 at 16 steps), so groups older than that are dropped (the
    # ledger's dropped_age) instead of trained. Fixed before the run that measured it.
    "m2po_limit": {"backlog": {**BACKLOG, "max_age_versions": STALENESS_LIMIT}, "algorithm": {"mismatch": "m2po"}},
    # backlog.order "freshest" (services/trainer/sources.py): the hot stream first, then segments newest
    # first, so the groups rollout makes during a burst, from the versions the trainer just published,
    # are trained before the backlog they would queue behind in "oldest" order.
    "fresh": {"backlog": {**BACKLOG, "order": "freshest"}, "algorithm": {"mismatch": "m2po"}},
    "fresh_limit": {
        "backlog": {**BACKLOG, "order": "freshest", "max_age_versions": STALENESS_LIMIT},
        "algorithm": {"mismatch": "m2po"},
    },
    # DAPO dynamic sampling on the backlog: with the limit, most of what the home cards make between
    # bursts is dropped unread (dropped_age: 2560-2952 of 3416-3944 groups in bench/burst.py's 3-round run of 2026-12-04),
    # so skipping a group whose rewards are all equal (no advantage, no gradient) costs the burst nothing
    # but a decode, and every step trains on groups that carry a signal. Chosen for that reason before
    # the run that measured it; the same job with dynamic_sampling off is m2po_limit.
    "m2po_limit_ds": {
        "backlog": {**BACKLOG, "max_age_versions": STALENESS_LIMIT},
        "algorithm": {"mismatch": "m2po", "dynamic_sampling": True},
    },
}
# The setups that also start a burst-side replica (a second rollout service, alive with the trainer),
# each with the setup whose job it runs unchanged: the replica's reading is the pair's ratio. Without
# the staleness limit (replica) a burst trains groups up to 255 versions old and the replica's fresh
# ones queue behind them; with it (replica_limit) the stale ones are dropped and the replica's groups,
# a few versions old, are what the burst trains.
REPLICA_OF = {"replica": "m2po", "replica_limit": "m2po_limit"}
SETUPS.update({rep: SETUPS[base] for rep, base in REPLICA_OF.items()})  # the same job, by construction
# Every setup read as a ratio to another that differs from it in one thing (no target in the issue:
# readings), with what the ratio says below 1x: the replica setups, and dynamic sampling.
PAIRED = {
    **{rep: (base, "the replica pays for its start-up and its share of the cores") for rep, base in REPLICA_OF.items()},
    "m2po_limit_ds": ("m2po_limit", "skipping the groups with no advantage pays"),
}
# Derived from SETUPS, so a new setup joins the rates, targets and readings that apply to it.
BACKLOG_SETUPS = tuple(s for s, spec in SETUPS.items() if "backlog" in spec)  # + the lag readings
RATE_SETUPS = tuple(s for s in BACKLOG_SETUPS if s not in REPLICA_OF)  # one rollout: its rate, the planner's check
M2PO_SETUPS = tuple(s for s in RATE_SETUPS if SETUPS[s]["algorithm"]["mismatch"] == "m2po")  # the targets
LABEL = {
    "windowed": "windowed (no backlog)",
    "tis": "backlog + truncated IS",
    "m2po": "backlog + M2PO",
    "replica": "backlog + M2PO + burst-side replica",
    "m2po_limit": f"backlog + M2PO, staleness limit {STALENESS_LIMIT}",
    "fresh": "backlog (freshest first) + M2PO",
    "fresh_limit": f"backlog (freshest first) + M2PO, staleness limit {STALENESS_LIMIT}",
    "replica_limit": f"backlog + M2PO, staleness limit {STALENESS_LIMIT} + burst-side replica",
    "m2po_limit_ds": f"backlog + M2PO, staleness limit {STALENESS_LIMIT}, dynamic sampling",
    "trl": "TRL GRPOTrainer in bursts",
}
LEAVE_IDLE_S = 2.0  # the backlog trainers' --leave-when-idle: no batch for this long, none left
