"""Publishing policy versions as the lease holder: write, keep or replace, announce.

A version exists once its manifest does (docs/architecture.md, invariant 5) and carries
the writer's lease epoch (invariant 10). When the trainer reaches a step whose version is
already in the store (it resumed from an older checkpoint), it keeps that version only if
the version is intact, was not written by a deposed trainer, and holds these weights (its
probe agrees with this trainer's); otherwise it writes it again: its files into a subfolder of
their own, then its manifest in place of the old one, which `put_manifest` (shared/folders.py)
removes only if it is not of a newer lease epoch and only while it is still the manifest it read
(a trainer deposed meanwhile gets LeaseLost, and its successor's version stays).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from shared.fence import refusal
from shared.folders import get_folder
from shared.lease import Lease
from shared.policy import (
    MANIFEST,
    Manifest,
    ProbeMismatch,
    VersionExists,
    advance_pointer,
    check_probe,
    publish_version,
    version_prefix,
)
from shared.store import ObjectStore, StoreError, VerificationError

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        store: ObjectStore,
        r: redis.Redis,
        job_id: str,
        base_model: str,
        *,
        lease: Lease | None,
        assert_lease: Callable[[], None],
        probe_tolerance: float,
    ) -> None:
        self.store, self.r, self.job_id, self.base_model = store, r, job_id, base_model
        self.lease, self.assert_lease, self.probe_tolerance = lease, assert_lease, probe_tolerance

    def exists(self, v: int) -> bool:
        return self.store.exists(f"{version_prefix(self.job_id, v)}/{MANIFEST}")

    def publish(self, v: int, files: dict[str, bytes], probe: dict[str, list]) -> float | None:
        """Publish version v (or keep the stored one if it is ours in all but name). Returns
        when the manifest was written now, or None when the stored version was kept."""
        replace = self.exists(v)
        if replace:
            why = self.problem(v, probe)
            if not why:
                log.info("job %s: policy v%d already published and matches these weights; keeping it", self.job_id, v)
                return None
            log.error("job %s: policy v%d in the store %s; publishing it again", self.job_id, v, why)
        m = Manifest(
            job_id=self.job_id,
            version=v,
            step=v,
            base_model=self.base_model,
            files={},
            probe=probe,
            epoch=self.lease.epoch if self.lease is not None else 0,
        )
        try:
            publish_version(self.store, m, files, before_manifest=self.assert_lease, replace=replace)
        except VersionExists:
            # It appeared between our look and our write: after a takeover that is the new
            # holder's version, so this trainer is deposed (LeaseLost), not facing a store fault.
            self.assert_lease()
            raise
        return m.created_at

    def problem(self, v: int, probe: dict[str, list]) -> str:
        """Why the stored version v must be replaced ("" when it may stay): torn or tampered
        files, a deposed trainer's write, or weights other than these (a forged version)."""
        try:
            meta, _ = get_folder(self.store, version_prefix(self.job_id, v))  # every hash checked
            m = Manifest(**meta)
        except (VerificationError, StoreError, ValueError, KeyError, TypeError) as e:
            return f"is corrupt ({type(e).__name__}: {e})"
        if why := refusal(self.store, self.job_id, "version", v, m.epoch):
            return f"was written by a deposed trainer ({why})"
        try:
            check_probe(m.probe, probe["logprobs"], self.probe_tolerance)
        except ProbeMismatch as e:
            return f"does not hold these weights ({e})"
        return ""

    def announce(self, v: int) -> None:
        """Move the policy pointer to v, as the lease holder (raises LeaseLost if deposed)."""
        if self.lease is not None:
            advance_pointer(self.r, self.job_id, v, self.lease.fence)
