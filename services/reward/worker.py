"""Reward worker: rollouts stream -> score -> scored stream (or ready, when no ref stage)."""

from __future__ import annotations

import logging

import msgspec

from shared import keys
from shared.bus import Bus, Entry
from shared.job import JobRecord, load_job
from shared.schema import GroupMsg, decode, encode
from shared.tasks import get_task
from shared.tasks.base import total

log = logging.getLogger(__name__)


def score_group(group: GroupMsg, rec: JobRecord) -> GroupMsg:
    """Fill reward and reward_parts of every completion. Verifier errors score 0, tagged."""
    task = get_task(rec.spec.task)
    for c in group.completions:
        try:
            parts = task.score(c.text, group.fields)
        except Exception as e:  # a verifier bug must not take the stage down
            log.warning("verifier %s failed on %s: %s", rec.spec.task, group.group_id, e)
            parts = {"verifier_error": 0.0}
        c.reward_parts = parts
        c.reward = total(parts)
    group.stage = "scored"
    return group


def handle(bus: Bus, entries: list[Entry]) -> int:
    """Score a batch of entries; each is forwarded (or dead-lettered) atomically."""
    jobs: dict[str, JobRecord | None] = {}
    done = 0
    for e in entries:
        if e.job_id not in jobs:
            jobs[e.job_id] = load_job(bus.r, e.job_id)
        rec = jobs[e.job_id]
        if rec is None:
            bus.dead_letter(e, f"unknown job {e.job_id}")
            continue
        try:
            group = decode(e.data, GroupMsg)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as err:
            bus.dead_letter(e, f"undecodable group: {err}")
            continue
        if group.stage != "rolled":
            bus.dead_letter(e, f"group at stage {group.stage!r}, expected 'rolled'")
            continue
        out = score_group(group, rec)
        dest = keys.scored(e.job_id) if rec.spec.uses_ref else keys.ready(e.job_id)
        if not rec.spec.uses_ref:
            out.stage = "ready"
        bus.forward([e], [(dest, encode(out))], {e.job_id: {"scored": 1}})
        done += 1
    return done
