"""The import-linter contracts (pyproject.toml, `make lint`) cover every module of the runtime core.

The core's contract names its modules one by one (import-linter cannot say "the modules of shared
but not its subpackages"): a new module in shared/ must join it, or it would escape the rule that
the core imports neither torch nor vllm nor the layers above it.
"""

from __future__ import annotations

import tomllib

from tests.support import ROOT


def test_every_core_module_is_in_the_core_contract() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["name"].startswith("the runtime core"))
    modules = {f"shared.{p.stem}" for p in (ROOT / "shared").glob("*.py") if p.stem != "__init__"}
    assert modules - set(core["source_modules"]) == set(), "add these to the core contract in pyproject.toml"
    assert set(core["source_modules"]) - modules == set(), "these are no longer modules of shared/"
