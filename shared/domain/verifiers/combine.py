"""Weighted combinations of verifiers, with every component kept as a reward part.

The parts of one completion are {part: weight * reward} plus zero-valued tags
"<part>!<reason>" for anything unusual (an error, a sandbox limit, no answer found), so
`sum(parts.values())` is the reward and a reward-hacking trend shows per component.
"""

from __future__ import annotations

import logging
import math
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


def split_parts(parts: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
    """(reward components, tags) of one completion's parts."""
    values = {k: v for k, v in parts.items() if TAG_SEP not in k}
    tags = [k for k in parts if TAG_SEP in k]
    return values, tags
