"""The object store: `file://<dir>` (embedded default) or `s3://bucket/prefix`.

Keys are '/'-separated. Writes are atomic per object (file: write to a temp file then
rename; S3: a PUT is atomic), which is what "a version exists once its manifest
does" builds on. A folder's files go under a write-once subfolder its manifest names
(`put_folder`'s `data_dir`), so a writer that outlived its lease can never overwrite a file
another writer's manifest names (docs/architecture.md, invariant 10).

S3 endpoint and credentials come from the environment (never from STORE_URL):
STORE_ENDPOINT_URL (or AWS_ENDPOINT_URL), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_REGION — so MinIO, R2 and S3 all work.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from shared.redact import redact_url


class StoreError(RuntimeError):
    pass


class VerificationError(StoreError):
    """A folder's files do not match its manifest; they must never be used."""


MANIFEST = "manifest.json"


class ObjectStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[str]: ...
    def list_dirs(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root not in p.parents:
            raise StoreError(f"key {key!r} escapes the store root")
        return p

    def put(self, key: str, data: bytes) -> None:
        p = self._path(key)
        for attempt in range(3):  # a concurrent delete may remove the folder it just emptied
            p.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StoreError(f"no object {key!r} in {self.url}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return []
        return sorted(
            str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")
        )

    def list_dirs(self, prefix: str) -> list[str]:
        """Names one level below `prefix` (a folder, ending in '/') that hold objects."""
        base = self._path(prefix) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".tmp-"))

    def delete(self, key: str) -> None:
        p = self._path(key)
        p.unlink(missing_ok=True)
        # Like S3, a folder exists only while it holds objects: remove the ones left empty. A
        # crashed write's temporary file is not an object: one left untouched for STALE_TMP_S goes
        # too (a folder holding only that was never removed, and every orphan sweep "deleted" it
        # again).
        for parent in p.parents:
            if parent == self.root or self.root not in parent.parents:
                break
            try:
                _drop_stale_temps(parent)
                parent.rmdir()
            except OSError:  # not empty (or already gone)
                break


STALE_TMP_S = 600.0  # a temporary file untouched this long belongs to a write that died (one put is one write)


def _drop_stale_temps(folder: Path) -> None:
    """Delete the temporary files of dead writes in `folder`, if it holds nothing else."""
    entries = list(folder.iterdir())
    cutoff = time.time() - STALE_TMP_S
    if all(e.name.startswith(".tmp-") and e.is_file() and e.stat().st_mtime < cutoff for e in entries):
        for e in entries:
            e.unlink(missing_ok=True)


class S3Store:
    def __init__(self, bucket: str, prefix: str) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}"
        endpoint = os.environ.get("STORE_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        self.s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=os.environ.get("AWS_REGION", "us-east-1"),
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5),
        )

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

    def get(self, key: str) -> bytes:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            raise StoreError(f"no object {key!r} in {self.url}") from None

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.s3.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def list(self, prefix: str) -> list[str]:
        out: list[str] = []
        strip = len(self.prefix) + 1 if self.prefix else 0
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._k(prefix))
        for page in pages:
            out.extend(o["Key"][strip:] for o in page.get("Contents", []))
        return sorted(out)

    def list_dirs(self, prefix: str) -> list[str]:
        """Names one level below `prefix` (ending in '/'), from S3's common prefixes: no full listing."""
        out: list[str] = []
        want = self._k(prefix)
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=want, Delimiter="/")
        for page in pages:
            out.extend(p["Prefix"][len(want) :].strip("/") for p in page.get("CommonPrefixes", []))
        return sorted(out)

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._k(key))


def open_store(url: str) -> ObjectStore:
    """Parse STORE_URL. Relative file:// paths are relative to the working directory."""
    u = urlparse(url)
    if u.scheme == "file":
        return FileStore(Path(u.netloc + u.path))
    if u.scheme == "s3":
        if not u.netloc:
            raise StoreError(f"STORE_URL {redact_url(url)!r} has no bucket: use s3://bucket/prefix")
        if u.password is not None:  # S3 credentials come from the environment, never the URL
            raise StoreError(
                f"STORE_URL {redact_url(url)!r} carries credentials: give them in AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY instead"
            )
        return S3Store(u.netloc, u.path)
    raise StoreError(f"STORE_URL {redact_url(url)!r}: scheme must be file:// or s3://")


def new_data_dir(epoch: int) -> str:
    """A subfolder name no other write uses: the writer's lease epoch (for whoever inspects the
    store) and a random part (two writes of one holder, or unfenced writers, never share it)."""
    return f"e{int(epoch)}-{secrets.token_hex(6)}"


def data_prefix(prefix: str, data_dir: str) -> str:
    """Where a folder's files are: under `data_dir` when its manifest names one, else (the layout
    written before write-once subfolders) beside the manifest. `data_dir` comes from a manifest,
    which a reader must not trust: it must be one plain name."""
    if not data_dir:
        return prefix
    if not isinstance(data_dir, str) or "/" in data_dir or "\\" in data_dir or data_dir in (".", ".."):
        raise VerificationError(f"{prefix}: manifest's data_dir {data_dir!r} is not a plain folder name")
    return f"{prefix}/{data_dir}"


def put_folder(
    store: ObjectStore,
    prefix: str,
    files: dict[str, bytes],
    meta: dict[str, Any],
    *,
    before_manifest: Callable[[], None] | None = None,
    data_dir: str = "",
) -> dict[str, Any]:
    """Write files, then manifest.json (meta + each file's sha256) last.

    The folder exists once its manifest does: a crash mid-upload leaves no folder.
    Policy versions and trainer checkpoints are both such folders. `before_manifest` runs
    between the files and the manifest and may raise to leave the folder nonexistent (the
    trainer checks it still holds its lease there: a long upload may have outlived it).

    `data_dir` (`new_data_dir`): the files go to prefix/data_dir/, which the manifest names. A
    writer frozen mid-upload that wakes after another wrote the same folder then writes only
    into its own subfolder: it can never overwrite a file the other's manifest names (it did:
    a deposed trainer's late optimizer file broke its successor's checkpoint).
    """
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    manifest = {**meta, **({"data_dir": data_dir} if data_dir else {}), "files": digests}
    base = data_prefix(prefix, data_dir)
    for name, data in files.items():
        store.put(f"{base}/{name}", data)
    if before_manifest is not None:
        before_manifest()
    store.put(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return manifest


def get_folder(store: ObjectStore, prefix: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and every file of a folder, each checked against its sha256."""
    manifest = json.loads(store.get(f"{prefix}/{MANIFEST}"))
    return manifest, get_files(store, data_prefix(prefix, manifest.get("data_dir", "")), manifest["files"])


def folder_file(store: ObjectStore, prefix: str, name: str) -> str:
    """The key of file `name` of a folder, as its manifest places it."""
    manifest = json.loads(store.get(f"{prefix}/{MANIFEST}"))
    return f"{data_prefix(prefix, manifest.get('data_dir', ''))}/{name}"


def get_files(store: ObjectStore, prefix: str, digests: dict[str, str]) -> dict[str, bytes]:
    """The files `digests` names (name -> sha256) under prefix, each checked against its sha256."""
    files = {}
    for name, digest in digests.items():
        data = store.get(f"{prefix}/{name}")
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise VerificationError(f"{prefix}/{name}: sha256 {got[:12]} != manifest {digest[:12]}")
        files[name] = data
    return files
