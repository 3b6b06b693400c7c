"""Reward worker: rollouts stream -> score -> scored stream (or ready, when no ref stage)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from services.reward.scorer import GroupWork, Scorer
from shared import keys
from shared.bus import Bus, Entry
from shared.domain.scoring import group_work
from shared.domain.tasks.base import total
from shared.domain.verifiers import TagBudget, split_parts
from shared.job import JobRecord, UnreadableJob, load_job
from shared.metrics import record_point
from shared.schema import GroupMsg, encode

log = logging.getLogger(__name__)


def work_for(group: GroupMsg, rec: JobRecord) -> GroupWork:
    return group_work(
        rec.spec,
        [c.text for c in group.completions],
        dict(group.fields),
        prompt=group.prompt,
        completion_tokens=[len(c.token_ids) // 4 for c in group.completions],  # int32 packed
    )


def apply_scores(group: GroupMsg, parts: list[dict[str, float]], tags: TagBudget | None = None) -> GroupMsg:
    """The group scored: each completion's parts merged into its own, its tags bounded by `tags`
    (the reward service's budget per job) before they reach labels, metric points and trackers."""
    for c, p in zip(group.completions, parts, strict=True):
        # Multi-turn episodes arrive with their environment's reward parts (and end tags,
        # e.g. "env!max_turns"): the reward is theirs plus the verifier's on the final answer.
        merged = dict(c.reward_parts)
        for k, v in p.items():
            merged[k] = merged.get(k, 0.0) + v
        c.reward_parts = tags.bound(group.job_id, merged) if tags is not None else merged
        c.reward = total(c.reward_parts)
    group.stage = "scored"
    return group


class JobStats:
    """Per-job reward breakdown of one batch, recorded as one metrics point."""

    def __init__(self) -> None:
        self.groups = 0
        self.rewards: list[float] = []
        self.parts: dict[str, list[float]] = defaultdict(list)
        self.tags: dict[str, int] = defaultdict(int)

    def add(self, group: GroupMsg) -> None:
        self.groups += 1
        for c in group.completions:
            self.rewards.append(c.reward)
            values, tags = split_parts(c.reward_parts)
            for k, v in values.items():
                self.parts[k].append(v)
            for t in tags:
                self.tags[t] += 1

    def point(self, seconds: float) -> dict[str, Any]:
        n = max(1, len(self.rewards))
        return {
            "groups": self.groups,
            "completions": len(self.rewards),
            "reward_mean": sum(self.rewards) / n,
            "reward_parts": {k: sum(v) / len(v) for k, v in self.parts.items()},
            "reward_tags": dict(self.tags),
            "seconds": round(seconds, 3),
        }


def handle(bus: Bus, entries: list[Entry], scorer: Scorer, on_tags: Any = None, tags: TagBudget | None = None) -> int:
    """Score a batch of entries (in parallel); each is forwarded (or dead-lettered) atomically."""
    t0 = time.monotonic()
    jobs: dict[str, JobRecord | str] = {}  # job id -> its record, or why there is none
    todo: list[tuple[Entry, GroupMsg, JobRecord]] = []
    for e, group in bus.decode(entries, GroupMsg):
        if e.job_id not in jobs:
            try:
                jobs[e.job_id] = load_job(bus.r, e.job_id) or f"unknown job {e.job_id}"
            except UnreadableJob as err:  # one bad record must not fail the batch of the others
                jobs[e.job_id] = str(err)
        rec = jobs[e.job_id]
        if isinstance(rec, str):
            bus.dead_letter(e, rec)
            continue
        if group.stage != "rolled":
            bus.dead_letter(e, f"group at stage {group.stage!r}, expected 'rolled'")
            continue
        todo.append((e, group, rec))
    results = scorer.score([work_for(g, rec) for _, g, rec in todo])
    stats: dict[str, JobStats] = defaultdict(JobStats)
    units: list[tuple[Entry, list[tuple[str, bytes]], dict[str, int]]] = []
    for (e, group, rec), parts in zip(todo, results, strict=True):
        out = apply_scores(group, parts, tags)
        dest = keys.scored(e.job_id) if rec.spec.uses_ref else keys.ready(e.job_id)
        if not rec.spec.uses_ref:
            out.stage = "ready"
        units.append((e, [(dest, encode(out))], {"scored": 1}))
        stats[e.job_id].add(out)
    # One round trip for the batch; each group still hands on atomically and at most once.
    handed_on = bus.settle(units)
    for job_id, st in stats.items():
        if on_tags is not None:
            on_tags(st.tags)
        record_point(bus.r, job_id, "reward", st.point(time.monotonic() - t0))
    return handed_on
