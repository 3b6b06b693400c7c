"""Folders in the object store: files, then a manifest.json naming them, written last.

Policy versions, trainer checkpoints, Tinker states and backlog segments are such folders: one
exists once its manifest does, and a reader checks every file against the sha256 it names.
The files go to a write-once subfolder the manifest names (`put_folder`'s `data_dir`), so a
writer that outlived its lease can never overwrite a file another writer's manifest names; and
the manifest is written only where none is (`put_manifest`), so such a writer can never
overwrite its successor's manifest either (docs/architecture.md, invariant 10).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

from shared.lease import LeaseLost
from shared.store import NoSuchObject, ObjectExists, ObjectStore, StoreError, VerificationError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


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
    """Write files, then manifest.json (meta + each file's sha256) last, by `put_manifest`.

    The folder exists once its manifest does: a crash mid-upload leaves no folder.
    Policy versions and trainer checkpoints are both such folders. `before_manifest` runs
    between the files and the manifest (and again before each step of replacing a manifest in
    the way) and may raise to leave the folder nonexistent (the trainer checks it still holds
    its lease there: a long upload may have outlived it).

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
    put_manifest(store, prefix, manifest, before_write=before_manifest)
    return manifest


MANIFEST_TRIES = 4  # a manifest in the way that changes again each time we look: give up, say so


def put_manifest(
    store: ObjectStore, prefix: str, manifest: dict[str, Any], *, before_write: Callable[[], None] | None = None
) -> None:
    """Write a folder's manifest where none is: the one rule for every manifest write
    (docs/architecture.md, invariant 10).

    A writer that checked its lease (`before_write`) and then froze can wake after its successor
    wrote the same folder; a plain PUT then replaced the successor's manifest, and the folder
    became unreadable (the fence refuses the deposed writer's). So the write is `put_new`, and a
    manifest in the way decides by the lease epoch each one carries (`epoch`):
    - the same bytes: this write, landed by an earlier try of it (a retried PUT);
    - a newer epoch: a trainer took the job over, so this writer is deposed: LeaseLost, and it
      writes nothing more;
    - an older or the same epoch (a deposed writer's late manifest; this holder's own earlier
      write of the folder; one without an epoch, from before fencing; or one that is not JSON,
      which no reader can use): after `before_write` again, it is deleted only if it is still the
      object read (`delete_if`: a newer holder's that replaced it meanwhile stays), then this one
      is written where none is, and the files the replaced one named are deleted.
    A manifest without an epoch (a backlog segment's: its writer holds no lease, and each
    segment has its own folder) replaces nothing: ObjectExists.
    """
    key = f"{prefix}/{MANIFEST}"
    body = json.dumps(manifest, indent=1).encode()
    mine = manifest.get("epoch")
    for _ in range(MANIFEST_TRIES):
        if before_write is not None:
            before_write()
        try:
            store.put_new(key, body)
            return
        except ObjectExists:
            pass
        try:
            raw, tag = store.get_tagged(key)
        except NoSuchObject:  # deleted since: write again
            continue
        if raw == body:
            return
        if not isinstance(mine, int):
            raise ObjectExists(f"{key}: a manifest is already there; this folder is written once")
        theirs, old_dir = _epoch_and_dir(raw)
        if theirs > mine:
            raise LeaseLost(
                f"{key} was written under lease epoch {theirs}, newer than this writer's {mine}: another trainer "
                "took the job over, so this one is deposed and writes nothing more"
            )
        if before_write is not None:
            before_write()
        if store.delete_if(key, tag):
            log.warning("%s: replacing the manifest of lease epoch %d with one of epoch %d", key, theirs, mine)
            _drop_files(store, prefix, old_dir, keep=manifest.get("data_dir", ""))
    raise StoreError(f"{key}: a manifest in the way changed each of {MANIFEST_TRIES} times it was read")


def _epoch_and_dir(raw: bytes) -> tuple[int, str]:
    """A stored manifest's lease epoch (0: from before fencing; -1: not a JSON object, so unusable to
    any reader) and its data subfolder ("" when it names none)."""
    try:
        meta = json.loads(raw)
    except ValueError:
        return -1, ""
    if not isinstance(meta, dict):
        return -1, ""
    epoch, data_dir = meta.get("epoch", 0), meta.get("data_dir", "")
    return (epoch if isinstance(epoch, int) else -1), (data_dir if isinstance(data_dir, str) else "")


def _drop_files(store: ObjectStore, prefix: str, data_dir: str, *, keep: str) -> None:
    """Delete the files of a replaced manifest's subfolder: no manifest names them any more (a Tinker
    state saved again under its name would otherwise leave one folder behind per save)."""
    if not data_dir or data_dir == keep:
        return
    try:
        for k in store.list(data_prefix(prefix, data_dir) + "/"):
            store.delete(k)
    except (StoreError, OSError) as e:  # clutter, not a correctness problem: retention removes it later
        log.warning("%s: could not delete the replaced files of %s: %s", prefix, data_dir, e)


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
