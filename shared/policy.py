"""Policy versions in the object store: immutable folders, manifest written last.

Layout: jobs/{job}/policy/v{N}/manifest.json, and the files it names (adapter_model.safetensors,
adapter_config.json) in the write-once subfolder it names, jobs/{job}/policy/v{N}/{data_dir}/
(shared/folders.py, `put_folder`: a deposed writer's late files never land on the ones a live
manifest names, and its late manifest never replaces a live one). Versions written before that have their files beside the manifest (no
data_dir) and read as before. A version exists once manifest.json does (docs/architecture.md,
invariant 5); readers verify every file's sha256 against it before use.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shared import keys
from shared.fence import refusal
from shared.folders import MANIFEST, data_prefix, get_files, new_data_dir, put_folder
from shared.lease import FENCE_CHECK, Fence, LeaseLost
from shared.store import ObjectStore, StoreError, VerificationError

__all__ = [
    "MANIFEST",
    "DeposedWrite",
    "VersionExists",
    "Manifest",
    "ManifestError",
    "ProbeMismatch",
    "VerificationError",
    "check_probe",
    "fetch_version",
    "latest_version",
    "make_probe",
    "parse_manifest",
    "publish_version",
    "read_pointer",
    "advance_pointer",
]

# KEYS: the lease, the pointer. ARGV: the lease value, the version. Moves the pointer only
# forward and only for the lease holder: 1 if it moved, 0 if not newer, -1 if the lease is lost.
ADVANCE_LUA = (
    FENCE_CHECK
    + """
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
local v = tonumber(ARGV[2])
if v > cur then redis.call('SET', KEYS[2], v) return 1 end
return 0
"""
)


def read_pointer(r: redis.Redis, job_id: str) -> int:
    """The newest published policy version of a job (0: the base model, nothing published yet)."""
    return pointer_of(r.get(keys.policy_pointer(job_id)))


def pointer_of(raw: bytes | None) -> int:
    """A job's pointer as read (GET)."""
    return int(raw or 0)


def init_pointer(pipe: redis.client.Pipeline, job_id: str, version: int = 0) -> None:
    """Set a job's pointer where no trainer holds its lease yet, inside the caller's MULTI: a new
    job starts at version 0 (the base model, no adapter; the api's create), and a job registered
    again after Redis lost it starts at its newest checkpoint's version (the api's recovery)."""
    pipe.set(keys.policy_pointer(job_id), max(0, int(version)))


def advance_pointer(r: redis.Redis, job_id: str, version: int, fence: Fence) -> bool:
    """Announce `version` as the newest, as the holder of `fence`'s lease (docs/architecture.md,
    invariant 10). Never moves backwards: a resumed trainer re-announcing an older version
    changes nothing. Returns whether the pointer moved; raises LeaseLost for a deposed trainer."""
    moved = int(r.eval(ADVANCE_LUA, 2, fence.key, keys.policy_pointer(job_id), fence.value, int(version)))
    if moved < 0:
        raise LeaseLost(f"job {job_id}: lease lost; not announcing v{version}")
    return moved == 1


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
    # The log-prob probe (see `make_probe`): {"token_ids": [...], "logprobs": [...]}.
    probe: dict[str, list] = field(default_factory=dict)
    epoch: int = 0  # the writer's lease epoch (shared/fence.py); 0: written before fencing
    data_dir: str = ""  # the write-once subfolder holding the files ("": beside the manifest, the old layout)


class ManifestError(StoreError):
    """A version's manifest is missing, not JSON, or lacks a field or has one of the wrong
    type: the version cannot be read at all (a reader refuses it until the manifest changes)."""


class DeposedWrite(VerificationError):
    """A version or checkpoint written by a trainer after another took its job over: never used."""


class VersionExists(StoreError):
    """A version's manifest is already in the store: versions are immutable. For a trainer that
    looked and found none, another writer got there first (after a takeover, the new holder)."""


class ProbeMismatch(VerificationError):
    """The engine's log-probs under a version differ from the trainer's: wrong or mis-loaded weights."""


def make_probe(token_ids: list[int], logprobs: list[float]) -> dict[str, list]:
    """The manifest's probe: a fixed token sequence and, for each token after the first,
    its log-prob given the tokens before it under the version's weights (temperature 1)."""
    if len(token_ids) < 2 or len(logprobs) != len(token_ids) - 1:
        raise ValueError(f"probe needs n >= 2 token ids and n - 1 log-probs, got {len(token_ids)}/{len(logprobs)}")
    return {"token_ids": [int(t) for t in token_ids], "logprobs": [float(x) for x in logprobs]}


def check_probe(probe: dict[str, list], got: list[float], tolerance: float) -> float:
    """Mean per-token |engine - trainer| log-prob difference; raises ProbeMismatch above tolerance.

    The mean, not the max: half-precision and quantized engines put a few unlikely tokens
    (log-probs near -15) off by several tenths while the rest agree, whereas wrong weights
    (a stale or foreign adapter, another base) move most tokens. On the tiny model in bf16,
    the right adapter's mean is <= 0.05 and a wrong one's >= 0.28; in fp32 they are ~1e-5
    and >= 0.3.
    """
    want = probe.get("logprobs") or []
    if len(got) != len(want) or not want:
        raise ProbeMismatch(f"probe: engine gave {len(got)} log-probs, manifest has {len(want)}")
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    mean = sum(diffs) / len(diffs)
    if not mean <= tolerance:  # `not <=` also refuses NaN
        raise ProbeMismatch(
            f"probe log-probs differ by {mean:.4g} on average, up to {max(diffs):.4g} (tolerance {tolerance:g})"
        )
    return mean


def publish_version(
    store: ObjectStore,
    manifest: Manifest,
    files: dict[str, bytes],
    *,
    before_manifest: Callable[[], None] | None = None,
    replace: bool = False,
) -> str:
    """Write files, then the manifest naming their hashes. Returns the version prefix.

    A version already in the store raises VersionExists, unless `replace`: the caller found it
    unusable (services/trainer/publishing.py). Either way the manifest goes in only by
    `put_manifest`'s rule: never over one of a newer lease epoch (LeaseLost then)."""
    prefix = version_prefix(manifest.job_id, manifest.version)
    if not replace and store.exists(f"{prefix}/{MANIFEST}"):
        raise VersionExists(f"{prefix} already exists: policy versions are immutable")
    manifest.data_dir = new_data_dir(manifest.epoch)
    meta = {k: v for k, v in manifest.__dict__.items() if k != "files"}
    manifest.files = put_folder(
        store, prefix, files, meta, before_manifest=before_manifest, data_dir=manifest.data_dir
    )["files"]
    return prefix


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "job_id": (str,),
    "version": (int,),
    "step": (int,),
    "base_model": (str,),
    "files": (dict,),
    "created_at": (int, float),
    "probe": (dict,),
    "epoch": (int,),
    "data_dir": (str,),
}
_REQUIRED = ("job_id", "version", "step", "base_model", "files")
assert set(_FIELD_TYPES) == {f.name for f in dataclasses.fields(Manifest)}


def parse_manifest(raw: bytes, where: str = "manifest") -> Manifest:
    """A version's manifest from its bytes; raises ManifestError, naming what is wrong.

    Manifests come from the store, which a reader must not trust (docs/architecture.md,
    invariant 8): every field is type-checked here, so nothing downstream meets a KeyError
    or a TypeError from a forged or torn manifest. File names are plain names: a reader
    writes each file into its own folder, and `../x` must not leave it."""
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where}: not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ManifestError(f"{where}: not a JSON object")
    if missing := [k for k in _REQUIRED if k not in meta]:
        raise ManifestError(f"{where}: missing {', '.join(missing)}")
    if unknown := sorted(set(meta) - set(_FIELD_TYPES)):
        raise ManifestError(f"{where}: unknown fields {', '.join(unknown)}")
    for k, v in meta.items():
        if not isinstance(v, _FIELD_TYPES[k]) or isinstance(v, bool):
            raise ManifestError(f"{where}: {k} is {type(v).__name__}, not {_FIELD_TYPES[k][0].__name__}")
    for name, digest in meta["files"].items():
        if not name or "/" in name or "\\" in name or name in (".", "..") or not isinstance(digest, str):
            raise ManifestError(f"{where}: bad file entry {name!r}: {digest!r}")
    try:
        data_prefix(where, meta.get("data_dir", ""))
    except VerificationError as e:
        raise ManifestError(str(e)) from None
    probe = meta.get("probe") or {}
    if probe:
        ids, lps = probe.get("token_ids"), probe.get("logprobs")
        if (
            set(probe) != {"token_ids", "logprobs"}
            or not isinstance(ids, list)
            or not isinstance(lps, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in lps)
            or len(ids) < 2
            or len(lps) != len(ids) - 1
        ):
            raise ManifestError(f"{where}: probe is not {{token_ids: n >= 2 ints, logprobs: n - 1 numbers}}")
    return Manifest(**meta)


def read_manifest(store: ObjectStore, job_id: str, version: int) -> Manifest:
    """A version's manifest alone (no file is read or verified)."""
    key = f"{version_prefix(job_id, version)}/{MANIFEST}"
    return parse_manifest(store.get(key), key)


def fetch_version(
    store: ObjectStore, job_id: str, version: int, dest: Path, *, manifest: Manifest | None = None
) -> Manifest:
    """Download a version into a fresh folder `dest`, verifying every hash and that no deposed
    trainer wrote it (raises DeposedWrite, a VerificationError, then).

    `manifest`: the version's manifest as the caller already read it (rollout keys its
    decisions on those exact bytes); the files are checked against it, not re-read."""
    if manifest is None:
        manifest = read_manifest(store, job_id, version)
    files = get_files(store, data_prefix(version_prefix(job_id, version), manifest.data_dir), manifest.files)
    if why := refusal(store, job_id, "version", version, manifest.epoch):
        raise DeposedWrite(why)
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
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
