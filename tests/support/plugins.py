"""Operator plugin modules for the registry tests: a module written to a test's folder and put
on sys.path (undone by the test's monkeypatch), as an operator's BURSTRL_*_PLUGINS would name it."""

from __future__ import annotations

from pathlib import Path

import pytest


def plugin_module(folder: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    """Write `source` as `folder/name.py`, importable as `name` for the rest of the test; returns `name`."""
    (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    return name
