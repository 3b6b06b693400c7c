"""Which groups the trainer may train: shape checks, staleness and age.

Pure functions over a group and the job spec, so the loop (services/trainer/loop.py) only
routes each group to its fate. Staleness: without a backlog a group may lag max_staleness
versions (beyond: dropped_stale). With a backlog the job deliberately trains older data, so
the limit is backlog.max_age_versions, plus backlog.max_age_hours since it was sampled
(beyond either: dropped_age).
"""

from __future__ import annotations

import time

from shared.job import JobSpec
from shared.schema import Completion, GroupMsg


def arrays_consistent(c: Completion) -> bool:
    """int32 ids, float32 log-probs, uint8 mask (and float32 ref log-probs) of one length, not empty."""
    n = len(c.token_ids) // 4
    return (
        n > 0
        and len(c.token_ids) == 4 * n
        and len(c.logprobs) == 4 * n
        and len(c.loss_mask) == n
        and (not c.ref_logprobs or len(c.ref_logprobs) == 4 * n)
    )


def not_trainable(g: GroupMsg, spec: JobSpec) -> str:
    """Why a group can never be trained (it goes to the dead-letter stream), or ""."""
    if g.stage != "ready" or (spec.uses_ref and not all(c.ref_logprobs for c in g.completions)):
        return f"group not ready for training (stage {g.stage!r}, ref log-probs missing?)"
    if not all(arrays_consistent(c) for c in g.completions):
        return "completion arrays of different lengths (token ids / log-probs / mask / ref)"
    if not g.completions or len(g.completions) != spec.group_size:
        return f"group has {len(g.completions)} completions, job wants {spec.group_size}"
    return ""


def staleness_limit(spec: JobSpec) -> int:
    """The most policy versions a trained group may lag the trainer."""
    return spec.backlog.max_age_versions if spec.backlog.enabled else spec.max_staleness


def too_old(g: GroupMsg, spec: JobSpec, version: int, now: float | None = None) -> str:
    """The ledger counter of a group too old to train (dropped_stale, dropped_age), or ""."""
    if version - g.policy_version > staleness_limit(spec):
        return "dropped_age" if spec.backlog.enabled else "dropped_stale"
    now = time.time() if now is None else now
    if spec.backlog.enabled and 0 < g.sampled_at < now - spec.backlog.max_age_hours * 3600:
        return "dropped_age"
    return ""
