"""Backlog segments in the object store: immutable, checksummed folders of ready groups.

Layout: jobs/{job}/backlog/{seg}/ holds `groups.msgpack` (a msgpack array of the groups exactly
as the ready stream carried them: shared/schema.py's encoding, no pickle) and then
`manifest.json` (the data file's sha256, the group count, bytes, policy_version and sampled_at
min/max), written last: a segment exists once its manifest does, and every read verifies the
hash against it. Which segments count, and how many of their groups are left, is the backlog
index's business (shared/backlog.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

import msgspec
import redis

from shared import keys
from shared.folders import MANIFEST, put_folder
from shared.schema import SCHEMA_VERSION, GroupMsg
from shared.store import ObjectStore, StoreError, VerificationError

DATA = "groups.msgpack"
FORMAT = 1
_list_of_bytes = msgspec.msgpack.Decoder(list[bytes])
_encoder = msgspec.msgpack.Encoder()


class GroupHead(msgspec.Struct, tag="group", tag_field="type", kw_only=True):
    """What a segment's summary needs of a GroupMsg; decoding only this skips the completions'
    arrays (the spiller's cost per group). The trainer decodes and checks every group in full."""

    v: int = SCHEMA_VERSION
    job_id: str
    policy_version: int
    sampled_at: float = 0.0


_head_decoder = msgspec.msgpack.Decoder(GroupHead)


def group_head(payload: bytes) -> GroupHead:
    """Raises msgspec.DecodeError / ValidationError, or TypeError for another schema version."""
    h = _head_decoder.decode(payload)
    if h.v != SCHEMA_VERSION:
        raise TypeError(f"schema version {h.v} is not {SCHEMA_VERSION}")
    return h


class SegmentRefused(VerificationError):
    """A segment that must never be trained: its files do not match its manifest, or are gone."""


def segment_prefix(job_id: str, seg: str) -> str:
    return f"jobs/{job_id}/backlog/{seg}"


def new_segment_id(r: redis.Redis, job_id: str) -> str:
    """Sortable by creation time (the trainer's `oldest` order), and unique by construction: the
    job's segment counter (keys.segment_seq, one INCR) tells every replica's segments apart, so
    no two spillers ever write one folder, whatever their clocks say."""
    return f"seg-{time.time_ns():020d}-{r.incr(keys.segment_seq(job_id)):08d}"


@dataclass
class SegmentInfo:
    """A segment's entry in the index (and the summary its manifest carries)."""

    groups: int
    remaining: int
    bytes: int
    v_min: int
    v_max: int
    t_min: float
    t_max: float
    created_at: float
    status: str = "ready"
    sha256: str = ""  # of the data file, as in the manifest: a reader that has the index needs no manifest read

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> SegmentInfo:
        d = json.loads(raw)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def pack(payloads: list[bytes], msgs: list[GroupMsg] | list[GroupHead]) -> tuple[bytes, SegmentInfo]:
    """The data file of a segment and its summary."""
    if not payloads or len(payloads) != len(msgs):
        raise ValueError(f"a segment needs one message per payload, got {len(payloads)}/{len(msgs)}")
    data = _encoder.encode(payloads)
    versions = [m.policy_version for m in msgs]
    sampled = [m.sampled_at for m in msgs]
    info = SegmentInfo(
        groups=len(payloads),
        remaining=len(payloads),
        bytes=len(data),
        v_min=min(versions),
        v_max=max(versions),
        t_min=round(min(sampled), 3),
        t_max=round(max(sampled), 3),
        created_at=round(time.time(), 3),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    return data, info


def write_segment(store: ObjectStore, job_id: str, seg: str, data: bytes, info: SegmentInfo) -> None:
    """Files, then the manifest (the segment exists from then on). Raises what the store raises."""
    meta = {"kind": "backlog-segment", "format": FORMAT, "job_id": job_id, "segment": seg, **asdict(info)}
    put_folder(store, segment_prefix(job_id, seg), {DATA: data}, meta)


def read_segment(store: ObjectStore, job_id: str, seg: str, info: SegmentInfo | None = None) -> list[bytes]:
    """The groups' payloads of a segment, verified against its manifest, or against `info` (its
    index entry, written after the manifest in the same script that acknowledged its groups:
    it carries the same sha256, so one read of the data is enough).

    Raises SegmentRefused for a segment that is corrupt, truncated, foreign or missing (never to
    be trained), and whatever the store raises for an outage (to be tried again later)."""
    prefix = segment_prefix(job_id, seg)
    try:
        if info is not None and info.sha256:
            manifest = {"files": {DATA: info.sha256}, "job_id": job_id, "segment": seg, "format": FORMAT}
            manifest["groups"] = info.groups
        else:
            manifest = json.loads(store.get(f"{prefix}/{MANIFEST}"))
        data = store.get(f"{prefix}/{DATA}")
    except StoreError as e:  # no such object: the index names a segment the store does not hold
        raise SegmentRefused(f"segment {seg}: {e}") from None
    except ValueError as e:
        raise SegmentRefused(f"segment {seg}: manifest is not JSON: {e}") from None
    want = (manifest.get("files") or {}).get(DATA)
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise SegmentRefused(
            f"segment {seg}: {DATA} sha256 {got[:12]} != manifest {str(want)[:12]} ({len(data)} bytes)"
        )
    if manifest.get("job_id") != job_id or manifest.get("segment") != seg or manifest.get("format") != FORMAT:
        raise SegmentRefused(
            f"segment {seg}: manifest names job {manifest.get('job_id')!r}, {manifest.get('segment')!r}"
        )
    try:
        payloads = _list_of_bytes.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SegmentRefused(f"segment {seg}: {DATA} does not decode: {e}") from None
    if len(payloads) != manifest.get("groups"):
        raise SegmentRefused(f"segment {seg}: holds {len(payloads)} groups, manifest says {manifest.get('groups')}")
    return payloads


def delete_segment(store: ObjectStore, job_id: str, seg: str) -> None:
    """Manifest first: a half-deleted segment no longer exists for any reader."""
    prefix = segment_prefix(job_id, seg)
    store.delete(f"{prefix}/{MANIFEST}")
    for key in store.list(prefix + "/"):
        store.delete(key)


def stored_segments(store: ObjectStore, job_id: str) -> list[str]:
    return store.list_dirs(f"jobs/{job_id}/backlog/")
