"""Registries of named things (verifiers, tasks, environments), and the operator-chosen plugin
modules that add to them.

A registry's built-ins are named in a table of "module:attribute" references, as Python's entry
points name theirs (shared/domain/catalog.py), and loaded the first time the registry is used:
registering them is explicit, in one place, and no module registers anything as a side effect of
being imported. Plugin modules are the exception by design: only a service's own settings name
them (BURSTRL_REWARD_PLUGINS, BURSTRL_ROLLOUT_ENV_PLUGINS), they are imported at start, and they
register what they bring. A job can only name what is already registered, so a job payload can
never make a service run new code.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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


class Registry(Generic[T]):
    """The `kind`s by name: the built-ins of `builtins` ({name: "module:attribute"}), loaded on
    first use, and whatever is registered.

    With `replace_silently`, registering a taken name replaces it (tasks: a later definition
    wins); otherwise a name taken by another object is refused unless `replace`: two plugins
    choosing one name would swap the code jobs run by import order."""

    def __init__(self, kind: str, builtins: Mapping[str, str], *, replace_silently: bool = False) -> None:
        self.kind = kind
        self._builtins = dict(builtins)
        self._table: dict[str, T] = {}
        self._replace_silently = replace_silently
        self._ready = False  # every built-in loaded
        self._loading = False
        # Other threads wait while one loads; reentrant, so that a built-in's module may use this
        # registry while it loads (it sees what is loaded so far).
        self._lock = threading.RLock()

    def _loaded(self) -> dict[str, T]:
        if not self._ready:
            with self._lock:
                if not self._ready and not self._loading:
                    self._loading = True
                    try:
                        for name, ref in self._builtins.items():
                            self._table.setdefault(name, pkgutil.resolve_name(ref))
                        self._ready = True
                    finally:
                        self._loading = False
        return self._table

    def register(self, name: str, obj: T | None = None, *, replace: bool = False) -> Any:
        """Put `obj` under `name`; without `obj`, the decorator that does."""

        def add(o: T) -> T:
            table = self._loaded()
            if name in table and table[name] is not o and not (replace or self._replace_silently):
                raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to override it")
            table[name] = o
            return o

        return add(obj) if obj is not None else add

    def get(self, name: str) -> T | None:
        return self._loaded().get(name)

    def names(self) -> list[str]:
        return sorted(self._loaded())

    def items(self) -> list[tuple[str, T]]:
        return list(self._loaded().items())
