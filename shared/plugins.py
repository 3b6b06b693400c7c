"""Operator-chosen plugin modules: imported at start, they register verifiers, tasks or envs.

Only a service's own settings name modules to import; a job can only name what is
already registered, so a job payload can never make a service run new code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def import_plugins(modules: Iterable[str], *, setting: str) -> list[str]:
    """Import each module named in `setting`; a failure says which setting to fix."""
    loaded = []
    for mod in (m.strip() for m in modules):
        if not mod:
            continue
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ImportError(f"plugin {mod!r} can't be imported ({e}); fix {setting}") from e
        loaded.append(mod)
    return loaded


def register(table: dict[str, F], kind: str, name: str, fn: F | None, *, replace: bool) -> Any:
    """Put `fn` in the `kind` registry `table` under `name`, or, without `fn`, return the decorator
    that does. A name taken by another function is refused unless `replace`: two plugins choosing
    one name would otherwise swap the code jobs run by import order."""

    def add(f: F) -> F:
        if name in table and table[name] is not f and not replace:
            raise ValueError(f"{kind} {name!r} is already registered; pass replace=True to override it")
        table[name] = f
        return f

    return add(fn) if fn is not None else add
