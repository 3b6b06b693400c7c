"""The tiny models the demo and the tests run on: shipped, so every machine runs the same bytes.

Each lives in shared/ml/weights/<name>/ (about 3.2 MB: a ~1M-parameter Qwen2 and a byte
tokenizer), built once by its recipe in shared/ml/recipes.py. `ensure_model` copies one into a
working folder (`.burstrl/models/<name>` for the demo, the CLI and the tests) in well under a
second: a user's first `make demo` no longer spends half an hour of one CPU thread on SFT, and
the tests' tolerances and learning margins rest on one model instead of a per-CPU build.

A copy carries MANIFEST naming the model and its weights' sha256: a folder whose bytes differ
from the shipped ones (an older copy, a rebuild) is replaced by the next `ensure_model`, unless it
was rebuilt on purpose (`rebuild=True` marks it so).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from shared.ml.recipes import RECIPES, build

WEIGHTS = Path(__file__).resolve().parent / "weights"
# The models that ship: the demo's (tiny-sft, and the tool-use demos' tiny-calc / tiny-python),
# the reasoning-gym demo's (tiny-sft-rg) and the distillation test's teacher (tiny-teacher).
SHIPPED = ("tiny-sft", "tiny-teacher", "tiny-calc", "tiny-python", "tiny-sft-rg")
MANIFEST = "burstrl_ready.json"  # {"model": name, "sha256": weights digest, "source": "shipped" | "rebuilt"}
WEIGHTS_FILE = "model.safetensors"
RG_MODEL_NAME = "tiny-sft-rg"  # its folder under <home>/models: examples/demo_rg.toml's base_model

Log = Callable[[str], None]


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()


def shipped_digest(name: str) -> str:
    """The sha256 of model `name`'s shipped weights, as its shipped manifest records it."""
    return json.loads((WEIGHTS / name / MANIFEST).read_text())["sha256"]


def _manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _ready(out: Path, name: str, *, rebuilt_ok: bool) -> bool:
    """Whether `out` holds model `name` whole: its weights hash to what its manifest says (a few ms),
    and that is the shipped digest, or it was rebuilt on purpose and `rebuilt_ok`."""
    m = _manifest(out)
    if m.get("model") != name or not (out / WEIGHTS_FILE).exists() or m.get("sha256") != _digest(out):
        return False
    if m.get("source") == "rebuilt":
        return rebuilt_ok
    return name in SHIPPED and m["sha256"] == shipped_digest(name)


def ensure_model(name: str, out: Path, *, rebuild: bool = False, log: Log = print) -> Path:
    """`out` holding model `name`, returned resolved.

    A shipped model is copied from shared/ml/weights/ (replacing whatever else `out` holds). With
    `rebuild`, or for a model that does not ship (tiny-countup), its recipe builds it instead (the
    student it starts from comes first, as a copy of the shipped one); a rebuilt folder is kept as
    it is by later calls without `rebuild`."""
    if name not in RECIPES:
        raise ValueError(f"no model named {name!r}; known: {', '.join(RECIPES)}")
    out = out.resolve()
    if rebuild or name not in SHIPPED:
        if not rebuild and _ready(out, name, rebuilt_ok=True):
            return out
        recipe = RECIPES[name]
        start = None
        if recipe.student is not None:
            start = ensure_model(recipe.student, out.parent / recipe.student, log=log)
        build(recipe, out, start=start, log=log)
        _write_manifest(out, name, "rebuilt")
        log(f"{name}: rebuilt by its recipe in {out}")
        return out
    if _ready(out, name, rebuilt_ok=True):
        return out
    install_shipped(name, out)
    return out


def install_shipped(name: str, out: Path) -> None:
    """Copy shipped model `name` into `out`, atomically: the copy is made beside `out` and renamed
    into place, so no reader ever sees half a folder (two processes may ask at once)."""
    src = WEIGHTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staged = tmp / name
        shutil.copytree(src, staged)
        if _digest(staged) != shipped_digest(name):
            raise RuntimeError(f"shipped model {src} does not match its manifest; reinstall burstrl")
        old = None
        if out.exists():
            old = tmp / "old"
            os.rename(out, old)
        os.rename(staged, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_manifest(folder: Path, name: str, source: str) -> None:
    (folder / MANIFEST).write_text(json.dumps({"model": name, "sha256": _digest(folder), "source": source}) + "\n")


def rebuild_shipped(into: Path = WEIGHTS, *, log: Log = print) -> list[Path]:
    """Rebuild every shipped model by its recipe into `into`/<name> (students first, each from its
    rebuilt student), with manifests that mark them as the shipped bytes: `make models`. Only a
    maintainer does this, then reviews `git diff --stat shared/ml/weights` and the tests."""
    made: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="burstrl-rebuild-") as work:
        built: dict[str, Path] = {}
        for name in sorted(SHIPPED, key=lambda n: RECIPES[n].student is not None):  # students first
            recipe = RECIPES[name]
            start = built.get(recipe.student) if recipe.student else None
            built[name] = build(recipe, Path(work) / name, start=start, log=log)
        for name, folder in built.items():
            dest = into / name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(folder, dest)
            _write_manifest(dest, name, "shipped")
            made.append(dest)
    return made


# The named models' usual call sites.
def ensure_tiny_model(out: Path, *, rebuild: bool = False, log: Log = print) -> Path:
    return ensure_model("tiny-sft", out, rebuild=rebuild, log=log)


def ensure_teacher_model(out: Path, *, rebuild: bool = False, log: Log = print) -> Path:
    return ensure_model("tiny-teacher", out, rebuild=rebuild, log=log)


def ensure_calc_model(out: Path, *, rebuild: bool = False, log: Log = print) -> Path:
    return ensure_model("tiny-calc", out, rebuild=rebuild, log=log)


def ensure_python_model(out: Path, *, rebuild: bool = False, log: Log = print) -> Path:
    return ensure_model("tiny-python", out, rebuild=rebuild, log=log)


def ensure_rg_model(out: Path, *, rebuild: bool = False, log: Log = print) -> Path:
    return ensure_model(RG_MODEL_NAME, out, rebuild=rebuild, log=log)
