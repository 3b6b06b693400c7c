"""The verifier registry: plain functions `(completions, **task_fields) -> rewards`, by name.

A verifier gets every completion of one group (same prompt) and the group's task
fields as keyword arguments (strings: "answer", "tests", ...), plus the `args` of its
entry in the job's task spec and a few context keywords every verifier may ignore:
`prompt`, `completion_tokens` (list[int]) and `max_tokens`. It returns one float per
completion, or a `Scored` (a float that also says why, e.g. "wall_time_limit").

The built-ins are named in shared/domain/catalog.py and loaded on first use. Plugins are
modules named in the reward service's own settings (BURSTRL_REWARD_PLUGINS) that call
`register_verifier` on import. A job payload only names verifiers: it can never make a
service import anything.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from shared.domain import catalog
from shared.plugins import Registry, import_plugins

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
    """A verifier was misconfigured (missing field, bad argument): the message says what to fix.

    `arg` names the argument at fault, when one is (the api's 422 points at it)."""

    def __init__(self, message: str, *, arg: str | None = None) -> None:
        super().__init__(message)
        self.arg = arg


ArgCheck = Callable[[Mapping[str, Any]], None]
_VERIFIERS: Registry[VerifierFn] = Registry("verifier", catalog.VERIFIERS)
_CHECKS: Registry[ArgCheck] = Registry("verifier arg check", catalog.VERIFIER_ARG_CHECKS, replace_silently=True)


def register_verifier(name: str, fn: VerifierFn | None = None, *, replace: bool = False) -> Any:
    """Register `fn` under `name`; usable as a decorator: `@register_verifier("mine")`."""
    return _VERIFIERS.register(name, fn, replace=replace)


def get_verifier(name: str) -> VerifierFn:
    fn = _VERIFIERS.get(name)
    if fn is None:
        raise VerifierError(
            f"unknown verifier {name!r}; known: {_VERIFIERS.names()} "
            "(plugins must be listed in the reward service's BURSTRL_REWARD_PLUGINS)"
        )
    return fn


def verifier_names() -> list[str]:
    return _VERIFIERS.names()


def register_arg_check(name: str) -> Callable[[ArgCheck], ArgCheck]:
    """Decorator: `check(args)` raises VerifierError for a job's args of verifier `name` that
    could never work (a regex that does not compile, a mode that does not exist). The api
    runs it at submission, so a bad config is a 422 naming the field, not a reward of 0
    with a "misconfigured" tag on every group."""

    return _CHECKS.register(name)


_SIMPLE = (str, int, float, bool, type(None))


def _accepted_types(hint: Any) -> tuple[type, ...] | None:
    """The plain JSON types a parameter annotated `hint` takes; None when it takes others too."""
    if hint in _SIMPLE:
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if all(a in _SIMPLE for a in args):
            return tuple(args)
    return None


def _fits(value: Any, accepted: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in accepted
    if isinstance(value, int) and float in accepted:
        return True
    return isinstance(value, accepted)


def check_verifier_args(name: str, args: Mapping[str, Any]) -> None:
    """Raise VerifierError (saying which argument and what it takes) for args verifier `name`
    cannot take: unknown names, wrong JSON types, values its own check refuses.

    A verifier whose catch-all keyword parameter is named `_` ignores the rest, so an
    unknown argument there is a typo; one that names it (`**fields`) reads them all.
    """
    fn = get_verifier(name)
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError):  # a plugin with annotations we cannot resolve
        sig, hints = None, {}
    if sig is not None:
        params = list(sig.parameters.values())[1:]  # the first is the completions
        named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        catch_all = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
        strict = catch_all is None or catch_all.name == "_"
        for key, value in args.items():
            if key not in named:
                if strict:
                    raise VerifierError(
                        f"verifier {name!r} takes no argument {key!r}; it takes {sorted(named)}", arg=key
                    )
                continue
            accepted = _accepted_types(hints.get(key))
            if accepted is not None and not _fits(value, accepted):
                want = " or ".join("null" if t is type(None) else t.__name__ for t in accepted)
                raise VerifierError(f"verifier {name!r} argument {key!r} must be {want}, got {value!r}", arg=key)
    if (check := _CHECKS.get(name)) is not None:
        check(args)


def load_plugins(modules: Iterable[str]) -> list[str]:
    """Import each plugin module (they register verifiers or tasks on import)."""
    return import_plugins(modules, setting="BURSTRL_REWARD_PLUGINS")
