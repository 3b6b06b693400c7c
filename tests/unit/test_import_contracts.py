"""The import-linter contracts (pyproject.toml, `make lint`) cover every module of the runtime core
and every benchmark.

The core's contract names its modules one by one (import-linter cannot say "the modules of shared
but not its subpackages"): a new module in shared/ must join it, or it would escape the rule that
the core imports neither torch nor vllm nor the layers above it.
"""

from __future__ import annotations

import tomllib

from tests.support import ROOT


def _contract(prefix: str) -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"].startswith(prefix))


def test_every_core_module_is_in_the_core_contract() -> None:
    core = _contract("the runtime core")
    modules = {f"shared.{p.stem}" for p in (ROOT / "shared").glob("*.py") if p.stem != "__init__"}
    assert modules - set(core["source_modules"]) == set(), "add these to the core contract in pyproject.toml"
    assert set(core["source_modules"]) - modules == set(), "these are no longer modules of shared/"


def test_every_benchmark_is_in_the_independence_contract() -> None:
    """A benchmark is a bench/*.py script that is not another's part (bench/<name>_*.py)."""
    names = {p.stem for p in (ROOT / "bench").glob("*.py")}
    benchmarks = {n for n in names if not any(n.startswith(f"{o}_") for o in names if o != n)}
    listed = {m.removeprefix("bench.") for m in _contract("no benchmark imports another")["modules"]}
    assert benchmarks == listed


def test_every_domain_module_is_a_layer_of_the_domain_contract() -> None:
    """shared/domain's layers contract names each of its modules and subpackages: a new one must
    take its place in it, or its imports would escape the rule that they point down."""
    domain = ROOT / "shared" / "domain"
    parts = {p.stem for p in domain.glob("*.py") if p.stem != "__init__"}
    parts |= {p.parent.name for p in domain.glob("*/__init__.py")}
    layers = _contract("inside the domain plugins")["layers"]
    assert parts == set(layers), "give these their layer in pyproject.toml"
