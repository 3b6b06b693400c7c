"""The object store: `file://<dir>` (embedded default) or `s3://bucket/prefix`.

Keys are '/'-separated. Writes are atomic per object (file: write to a temp file then
rename; S3: a PUT is atomic), which is what "a version exists once its manifest
does" builds on; `put_new` writes only where no object is (S3: a conditional PUT; file://
a hard link), which is what a manifest's write builds on (shared/folders.py:
docs/architecture.md, invariant 10).

S3 endpoint and credentials come from the environment (never from STORE_URL):
STORE_ENDPOINT_URL (or AWS_ENDPOINT_URL), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_REGION — so MinIO, R2 and S3 all work.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from shared.redact import redact_url

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    pass


class NoSuchObject(StoreError):
    """The key holds no object."""


class ObjectExists(StoreError):
    """`put_new` found the key taken: nothing was written."""


class VerificationError(StoreError):
    """A folder's files do not match its manifest; they must never be used."""


class ObjectStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def put_new(self, key: str, data: bytes) -> None:
        """Write only if the key holds no object, atomically; raises ObjectExists otherwise."""
        ...

    def get(self, key: str) -> bytes: ...
    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The object and a tag naming this write of it, for `delete_if`."""
        ...

    def delete_if(self, key: str, tag: str) -> bool:
        """Delete the object only if it is still the write `tag` names; False if it is not (or gone)."""
        ...

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

    def _temp_file(self, p: Path, data: bytes) -> str:
        """`data` in a new temporary file beside `p`, on disk."""
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
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: bytes) -> None:
        p = self._path(key)
        tmp = self._temp_file(p, data)
        try:
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_new(self, key: str, data: bytes) -> None:
        p = self._path(key)
        tmp = self._temp_file(p, data)
        try:
            os.link(tmp, p)  # atomic, and fails on an existing name (os.replace would overwrite it)
        except FileExistsError:
            raise ObjectExists(f"{key!r} already exists in {self.url}") from None
        finally:
            Path(tmp).unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NoSuchObject(f"no object {key!r} in {self.url}") from None

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, hashlib.sha256(data).hexdigest()

    def delete_if(self, key: str, tag: str) -> bool:
        """POSIX has no compare-and-delete: take the object aside with an atomic rename, then delete
        it if it is the one `tag` names, else link it back. Unlike reading, comparing and unlinking,
        this never removes a newer object that landed after the caller's read: it is only hidden
        for the instant it is aside (and stays aside only if yet another lands in that instant)."""
        p = self._path(key)
        aside = p.with_name(f".tmp-aside-{secrets.token_hex(6)}")
        try:
            os.rename(p, aside)
        except FileNotFoundError:
            return False
        try:
            if hashlib.sha256(aside.read_bytes()).hexdigest() == tag:
                aside.unlink()
                self._drop_empty_parents(p)
                return True
            try:
                os.link(aside, p)
            except FileExistsError:  # another object was written there meanwhile: that one stays
                log.warning("%s: an object taken aside was replaced meanwhile; kept the newer one", key)
            return False
        finally:
            aside.unlink(missing_ok=True)

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
        self._drop_empty_parents(p)

    def _drop_empty_parents(self, p: Path) -> None:
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
        self._conditional_ok = False  # _check_conditional_writes ran and the store honours If-None-Match

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

    def put_new(self, key: str, data: bytes) -> None:
        """S3's conditional PUT (If-None-Match: *): the server refuses it, atomically, where the key
        holds an object (412). A 409 means a conditional write of the same key was in flight: try again."""
        from botocore.exceptions import ClientError

        self._check_conditional_writes()
        for attempt in range(CONFLICT_TRIES):
            try:
                self.s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*")
                return
            except ClientError as e:
                code = _error_code(e)
                if code == "PreconditionFailed":
                    raise ObjectExists(f"{key!r} already exists in {self.url}") from None
                if code != "ConditionalRequestConflict" or attempt == CONFLICT_TRIES - 1:
                    raise
                time.sleep(0.05 * 2**attempt)

    def _check_conditional_writes(self) -> None:
        """Refuse a store that ignores If-None-Match (older S3-compatible servers do, silently): a
        deposed trainer's manifest could overwrite its successor's there. One PUT per store object
        once CHECK_KEY exists (a refused PUT proves it), two the first time; nothing to clean up."""
        from botocore.exceptions import ClientError

        if self._conditional_ok:
            return
        for _ in range(2):
            try:
                self.s3.put_object(Bucket=self.bucket, Key=self._k(CHECK_KEY), Body=CHECK_BODY, IfNoneMatch="*")
            except ClientError as e:
                if _error_code(e) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise
                self._conditional_ok = True
                return
        raise StoreError(
            f"object store {self.url} ignores If-None-Match on PUT (it wrote {CHECK_KEY} twice): burstrl writes "
            "every manifest only where none is, so that a deposed trainer can never overwrite its successor's; "
            "use a store with conditional writes (AWS S3, MinIO, Cloudflare R2 have them)"
        )

    def get(self, key: str) -> bytes:
        return self.get_tagged(key)[0]

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The object and its ETag."""
        try:
            got = self.s3.get_object(Bucket=self.bucket, Key=self._k(key))
        except self.s3.exceptions.NoSuchKey:
            raise NoSuchObject(f"no object {key!r} in {self.url}") from None
        return got["Body"].read(), got["ETag"]

    def delete_if(self, key: str, tag: str) -> bool:
        """S3's conditional delete (If-Match: the ETag read): 412 when another write replaced it. A
        server without conditional deletes (AWS S3 has them since 2025; not every S3-compatible one
        does) ignores the header and deletes: the caller's lease check just before is then the guard."""
        from botocore.exceptions import ClientError

        try:
            self.s3.delete_object(Bucket=self.bucket, Key=self._k(key), IfMatch=tag)
            return True
        except ClientError as e:
            if _error_code(e) in ("PreconditionFailed", "NoSuchKey", "404", "ConditionalRequestConflict"):
                return False
            raise

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


CONFLICT_TRIES = 4  # S3 answers 409 to a conditional write while another to the same key is in flight
CHECK_KEY = ".burstrl/conditional-writes"  # outside jobs/: no listing of a job ever meets it
CHECK_BODY = b"burstrl checks that this store refuses a second PUT here with If-None-Match: *\n"


def _error_code(e: Exception) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


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
