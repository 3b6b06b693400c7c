"""A machine-wide cache of built tiny models, keyed by everything that decides their weights.

Why: the demo and test models are built by SFT on one thread (shared/ml/threads.py), minutes of
CPU each, and every fresh clone (a CI run, a second checkout) built them again although the same
code on the same machine gives the same bytes (tests/integration/test_model_builds.py). So a
build is stored under a key, and a later build with the same key copies it instead.

The key is a sha256 of:
- the recipe (the caller's description: its name and, for a model built from another, that
  model's weights' digest);
- every .py file under shared/ (the builders, the tasks whose data they train on, the
  tokenizer code): any change there rebuilds, never a stale model from old code;
- the versions of Python and of the libraries a build runs (torch, transformers, trl,
  tokenizers, datasets, reasoning-gym);
- the CPU's model name and flags: another ISA may pick other kernels and build other weights.

Only the `ensure_*` builders of shared/ml/models.py use it, whose SFT is fixed in shared/'s
source. A build given its own callable (a test's short SFT) is not cached: the recipe name alone
does not say what that callable does.

BURSTRL_MODEL_CACHE picks the folder (default $XDG_CACHE_HOME/burstrl/models, else
~/.cache/burstrl/models); "off" turns the cache off. Entries are a few MB each; delete the folder
to clear it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

__all__ = ["CACHE_ENV", "build_key", "cache_root", "restore", "store"]

CACHE_ENV = "BURSTRL_MODEL_CACHE"
_SHARED = Path(__file__).resolve().parents[1]  # shared/
_LIBS = ("torch", "transformers", "trl", "tokenizers", "datasets", "reasoning-gym")
_ENTRY_DONE = "burstrl_cache_entry.json"  # written last: an entry without it is incomplete


def cache_root() -> Path | None:
    """The cache's folder, or None when BURSTRL_MODEL_CACHE is "off"."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given.lower() in ("off", "0", "false", "no"):
        return None
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "burstrl" / "models"


def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_SHARED.rglob("*.py")):
        h.update(str(path.relative_to(_SHARED)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for lib in _LIBS:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = "absent"
    return out


def _cpu() -> str:
    """The first processor's model name and flags (what decides which kernels run)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    first = text.split("\n\n", 1)[0]
    keep = [ln for ln in first.splitlines() if ln.split(":", 1)[0].strip() in ("model name", "flags", "Features")]
    return platform.machine() + "\n" + "\n".join(keep)


def build_key(recipe: dict[str, str]) -> str:
    """The cache key of a build described by `recipe` (see the module docstring)."""
    parts = {"recipe": recipe, "source": _source_digest(), "versions": _versions(), "cpu": _cpu()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def restore(key: str, out: Path) -> bool:
    """Copy the cached build `key` into `out` (replacing it); False when there is none."""
    root = cache_root()
    entry = root / key if root else None
    if entry is None or not (entry / _ENTRY_DONE).exists():
        return False
    staging = out.parent / f".{out.name}.restoring"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(entry, staging)
    (staging / _ENTRY_DONE).unlink()
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return True


def store(key: str, out: Path) -> None:
    """Put the finished build in `out` in the cache under `key`. A cache that cannot be written
    (read-only home, full disk) costs the next clone a rebuild, never this build."""
    root = cache_root()
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        shutil.copytree(out, staging, dirs_exist_ok=True)
        (staging / _ENTRY_DONE).write_text(json.dumps({"key": key}))
        try:
            staging.rename(root / key)  # atomic; another process may have stored it first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        return
