"""Weighted combinations of verifiers, with every component kept as a reward part.

The parts of one completion are {part: weight * reward} plus zero-valued tags
"<part>!<reason>" for anything unusual (an error, a sandbox limit, no answer found), so
`sum(parts.values())` is the reward and a reward-hacking trend shows per component.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from shared.domain.verifiers.registry import VerifierError, get_verifier

log = logging.getLogger(__name__)

TAG_SEP = "!"
QUIET_REASONS = {"", "ok", "wrong_answer"}  # normal outcomes: no tag


def error_tag(e: BaseException) -> str:
    from shared.domain.sandbox import SandboxUnavailable

    if isinstance(e, SandboxUnavailable):
        return "sandbox_unavailable"
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, VerifierError):
        return "misconfigured"
    return f"error:{type(e).__name__}"


def score_components(
    components: Sequence[Any],
    completions: Sequence[str],
    fields: Mapping[str, str],
    *,
    prompt: str = "",
    completion_tokens: Sequence[int] | None = None,
    max_tokens: int | None = None,
) -> list[dict[str, float]]:
    """Run each component (anything with name, weight, part, args) on the whole group.

    A component that raises scores 0 for the group with an error tag; it never raises.
    """
    parts: list[dict[str, float]] = [{} for _ in completions]
    ctx = {"prompt": prompt, "completion_tokens": list(completion_tokens or []), "max_tokens": max_tokens}
    if completion_tokens is None:
        ctx.pop("completion_tokens")
    for comp in components:
        part = comp.part or comp.name
        try:
            fn = get_verifier(comp.name)
            values = list(fn(list(completions), **{**fields, **ctx, **comp.args}))
            if len(values) != len(completions):
                raise VerifierError(f"verifier {comp.name!r} returned {len(values)} rewards for {len(completions)}")
        except Exception as e:  # a verifier bug or a bad config must not take the stage down
            tag = error_tag(e)
            log.warning("verifier %s failed (%s): %s", comp.name, tag, e)
            for p in parts:
                p[part] = 0.0
                p[f"{part}{TAG_SEP}{tag}"] = 0.0
            continue
        for p, v in zip(parts, values, strict=True):
            x = float(v)
            if not math.isfinite(x):
                p[part], p[f"{part}{TAG_SEP}nonfinite"] = 0.0, 0.0
                continue
            p[part] = comp.weight * x
            reason = getattr(v, "reason", "")
            if reason not in QUIET_REASONS:
                p[f"{part}{TAG_SEP}{reason}"] = 0.0
    return parts


# Tags drawn from completions (a verifier's reason, an exception's kind) become Prometheus label
# values, metric-point keys and tracker metric names, which last as long as the service or the
# job: each is bounded in length and in how many distinct ones a job may show, and the rest
# fold into "<part>!other" (issue 47: one completion's 100,000-character class name was a 100 kB
# label series forever).
TAG_REASON = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
TAGS_PER_JOB = 64
OTHER = "other"


class TagBudget:
    """The distinct tags each job has shown, at most `per_job`; the jobs it remembers, at most
    `max_jobs` (the least recently seen is forgotten). One per reward service process."""

    def __init__(self, per_job: int = TAGS_PER_JOB, max_jobs: int = 10_000) -> None:
        self.per_job = per_job
        self.max_jobs = max_jobs
        self._seen: OrderedDict[str, set[str]] = OrderedDict()

    def bound(self, job_id: str, parts: Mapping[str, float]) -> dict[str, float]:
        """`parts` with every tag within bounds: a tag whose reason is too long or holds other
        characters than [A-Za-z0-9_.:-], or one past the job's budget, becomes "<part>!other"."""
        seen = self._seen.pop(job_id, set())
        self._seen[job_id] = seen  # most recently seen last
        while len(self._seen) > self.max_jobs:
            self._seen.popitem(last=False)
        out: dict[str, float] = {}
        for key, value in parts.items():
            part, sep, reason = key.partition(TAG_SEP)
            if sep:
                if not TAG_REASON.fullmatch(reason) or (key not in seen and len(seen) >= self.per_job):
                    key = f"{part}{TAG_SEP}{OTHER}"
                else:
                    seen.add(key)
            out[key] = out.get(key, 0.0) + value
        return out


def split_parts(parts: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
    """(reward components, tags) of one completion's parts."""
    values = {k: v for k, v in parts.items() if TAG_SEP not in k}
    tags = [k for k in parts if TAG_SEP in k]
    return values, tags
