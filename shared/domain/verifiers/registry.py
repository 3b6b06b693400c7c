"""The verifier registry: plain functions `(completions, **task_fields) -> rewards`, by name.

A verifier gets every completion of one group (same prompt) and the group's task
fields as keyword arguments (strings: "answer", "tests", ...), plus the `args` of its
entry in the job's task spec and a few context keywords every verifier may ignore:
`prompt`, `completion_tokens` (list[int]) and `max_tokens`. It returns one float per
completion, or a `Scored` (a float that also says why, e.g. "wall_time_limit").

Plugins are modules named in the reward service's own settings (BURSTRL_REWARD_PLUGINS)
that call `register_verifier` on import. A job payload only names verifiers: it can
never make a service import anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shared.plugins import import_plugins

VerifierFn = Callable[..., Sequence[float]]


class Scored(float):
    """A reward that carries its reason ("ok", "wrong_answer", "no_answer", ...)."""

    reason: str

    def __new__(cls, value: float, reason: str = "") -> Scored:
        obj = super().__new__(cls, value)
        obj.reason = reason
        return obj

    def __reduce__(self) -> tuple[Any, ...]:  # survives the reward service's process pool
        return (Scored, (float(self), self.reason))


class VerifierError(ValueError):
    """A verifier was misconfigured (missing field, bad argument): the message says what to fix."""


_VERIFIERS: dict[str, VerifierFn] = {}


def register_verifier(name: str, fn: VerifierFn | None = None, *, replace: bool = False) -> Any:
    """Register `fn` under `name`; usable as a decorator: `@register_verifier("mine")`."""

    def add(f: VerifierFn) -> VerifierFn:
        if name in _VERIFIERS and _VERIFIERS[name] is not f and not replace:
            raise ValueError(f"verifier {name!r} is already registered; pass replace=True to override it")
        _VERIFIERS[name] = f
        return f

    return add(fn) if fn is not None else add


def get_verifier(name: str) -> VerifierFn:
    try:
        return _VERIFIERS[name]
    except KeyError:
        raise VerifierError(
            f"unknown verifier {name!r}; known: {sorted(_VERIFIERS)} "
            "(plugins must be listed in the reward service's BURSTRL_REWARD_PLUGINS)"
        ) from None


def verifier_names() -> list[str]:
    return sorted(_VERIFIERS)


def load_plugins(modules: Iterable[str]) -> list[str]:
    """Import each plugin module (they register verifiers or tasks on import)."""
    return import_plugins(modules, setting="BURSTRL_REWARD_PLUGINS")
