"""Policy versions in the object store: immutable folders, manifest written last.

Layout: jobs/{job}/policy/v{N}/{adapter_model.safetensors, adapter_config.json,
manifest.json}. A version exists once manifest.json does (ARCHITECTURE invariant 5);
readers verify every file's sha256 against it before use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.store import MANIFEST, ObjectStore, StoreError, VerificationError, get_folder, put_folder

__all__ = ["MANIFEST", "Manifest", "VerificationError", "fetch_version", "latest_version", "publish_version"]


def version_prefix(job_id: str, version: int) -> str:
    return f"jobs/{job_id}/policy/v{version}"


@dataclass
class Manifest:
    job_id: str
    version: int
    step: int
    base_model: str
    files: dict[str, str]  # name -> sha256
    created_at: float = field(default_factory=time.time)
    probe: dict[str, list] = field(default_factory=dict)  # token ids and expected log-probs


def publish_version(store: ObjectStore, manifest: Manifest, files: dict[str, bytes]) -> str:
    """Write files, then the manifest naming their hashes. Returns the version prefix."""
    prefix = version_prefix(manifest.job_id, manifest.version)
    if store.exists(f"{prefix}/{MANIFEST}"):
        raise StoreError(f"{prefix} already exists: policy versions are immutable")
    meta = {k: v for k, v in manifest.__dict__.items() if k != "files"}
    manifest.files = put_folder(store, prefix, files, meta)["files"]
    return prefix


def fetch_version(store: ObjectStore, job_id: str, version: int, dest: Path) -> Manifest:
    """Download a version into a fresh folder `dest`, verifying every hash."""
    meta, files = get_folder(store, version_prefix(job_id, version))
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (dest / name).write_bytes(data)
    return Manifest(**meta)


def latest_version(store: ObjectStore, job_id: str) -> int:
    """Highest version with a manifest (-1 when none): the store is the source of truth."""
    best = -1
    for key in store.list(f"jobs/{job_id}/policy/"):
        parts = key.split("/")
        if len(parts) == 5 and parts[4] == MANIFEST and parts[3].startswith("v"):
            best = max(best, int(parts[3][1:]))
    return best
