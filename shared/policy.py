"""Policy versions in the object store: immutable folders, manifest written last.

Layout: jobs/{job}/policy/v{N}/{adapter_model.safetensors, adapter_config.json,
manifest.json}. A version exists once manifest.json does (ARCHITECTURE invariant 5);
readers verify every file's sha256 against it before use.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.store import ObjectStore, StoreError

MANIFEST = "manifest.json"


class VerificationError(StoreError):
    """A version's files do not match its manifest; it must never be served."""


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

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        return cls(**json.loads(data))


def publish_version(store: ObjectStore, manifest: Manifest, files: dict[str, bytes]) -> str:
    """Write files, then the manifest naming their hashes. Returns the version prefix."""
    prefix = version_prefix(manifest.job_id, manifest.version)
    if store.exists(f"{prefix}/{MANIFEST}"):
        raise StoreError(f"{prefix} already exists: policy versions are immutable")
    manifest.files = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    for name, data in files.items():
        store.put(f"{prefix}/{name}", data)
    store.put(f"{prefix}/{MANIFEST}", manifest.to_json())
    return prefix


def fetch_version(store: ObjectStore, job_id: str, version: int, dest: Path) -> Manifest:
    """Download a version into a fresh folder `dest`, verifying every hash."""
    prefix = version_prefix(job_id, version)
    manifest = Manifest.from_json(store.get(f"{prefix}/{MANIFEST}"))
    dest.mkdir(parents=True, exist_ok=True)
    for name, digest in manifest.files.items():
        data = store.get(f"{prefix}/{name}")
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise VerificationError(f"{prefix}/{name}: sha256 {got[:12]} != manifest {digest[:12]}")
        (dest / name).write_bytes(data)
    return manifest


def latest_version(store: ObjectStore, job_id: str) -> int:
    """Highest version with a manifest (-1 when none): the store is the source of truth."""
    best = -1
    for key in store.list(f"jobs/{job_id}/policy/"):
        parts = key.split("/")
        if len(parts) == 5 and parts[4] == MANIFEST and parts[3].startswith("v"):
            best = max(best, int(parts[3][1:]))
    return best
