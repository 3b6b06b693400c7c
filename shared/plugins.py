"""Operator-chosen plugin modules: imported at start, they register verifiers, tasks or envs.

Only a service's own settings name modules to import; a job can only name what is
already registered, so a job payload can never make a service run new code.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable


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
