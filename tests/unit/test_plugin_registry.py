"""The registries of tasks, environments and verifiers (shared/plugins.py, `Registry`): the
built-ins, named in shared/domain/catalog.py, are there the first time a registry is used and
never before (no module registers anything when imported), and a plugin cannot take a built-in's
name by registering first."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from shared.domain import catalog
from shared.domain.tasks import rg
from shared.plugins import Registry
from tests.support import ROOT


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_importing_a_builtin_registers_nothing() -> None:
    # A fresh process: the modules load, and every registry is still untouched.
    _run(
        "import shared.domain.envs.calc, shared.domain.verifiers.basic, shared.domain.tasks.arith\n"
        "from shared.domain.envs.base import _ENVS\n"
        "from shared.domain.tasks.base import _TASKS\n"
        "from shared.domain.verifiers.registry import _VERIFIERS\n"
        "assert not (_ENVS._table or _TASKS._table or _VERIFIERS._table)\n"
    )


def test_every_builtin_is_found_by_name_in_a_fresh_process() -> None:
    _run(
        "from shared.domain import catalog\n"
        "from shared.domain.envs import env_names\n"
        "from shared.domain.tasks import task_names\n"
        "from shared.domain.verifiers import verifier_names\n"
        "assert task_names() == sorted(catalog.TASKS), task_names()\n"
        "assert env_names() == sorted(catalog.ENVS), env_names()\n"
        "assert verifier_names() == sorted(catalog.VERIFIERS), verifier_names()\n"
    )


def test_a_plugin_cannot_take_a_builtin_name_before_the_registry_is_used() -> None:
    _run(
        "from shared.domain.verifiers import register_verifier\n"
        "try:\n"
        "    register_verifier('exact', lambda c, **_: [0.0] * len(c))\n"
        "except ValueError as e:\n"
        "    assert 'already registered' in str(e)\n"
        "else:\n"
        "    raise AssertionError('a plugin replaced the built-in exact verifier')\n"
    )


def test_the_rg_family_is_registered_under_its_prefix() -> None:
    assert list(catalog.TASK_FAMILIES) == [rg.PREFIX]


def test_threads_that_use_a_registry_first_all_see_every_builtin() -> None:
    reg: Registry[object] = Registry("thing", {f"n{i}": f"json:{n}" for i, n in enumerate(["dumps", "loads"])})
    seen: list[list[str]] = []
    threads = [threading.Thread(target=lambda: seen.append(reg.names())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [["n0", "n1"]] * 8


def test_a_taken_name_is_refused_unless_replaced() -> None:
    reg: Registry[object] = Registry("thing", {"a": "json:dumps"})
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a", print)
    assert reg.register("a", print, replace=True) is print and reg.get("a") is print
    lenient: Registry[object] = Registry("task", {"a": "json:dumps"}, replace_silently=True)
    lenient.register("a", print)
    assert lenient.get("a") is print
