"""The one place that tells the world what rollout decided about a version or a job.

Each decision shows in four places at once: /readyz (the job's `policy:{job}` check),
Prometheus metrics, the job record's `error` (GET /v1/jobs/{id}, through
shared.job.update_job) and the job's metrics stream (source "rollout_version"), plus the log.
- a version adopted: healthy again, its publish -> adopt latency, the job's error cleared;
- a version refused: degraded with the reason, `burstrl_rollout_verify_failures{kind}`;
- a job refused (this pool cannot serve it now) or accepted again: `burstrl_rollout_job_refused`.
"""

from __future__ import annotations

import logging
import time

import redis
from prometheus_client import Counter, Gauge, Histogram

from services.rollout.served import ServedJob
from shared.job import JobRecord, update_job
from shared.metrics import record_point
from shared.policy import Manifest
from shared.service import ServiceRuntime

log = logging.getLogger(__name__)
JOB_ERROR_PREFIX = "rollout: "  # the job-record errors this service sets (and may clear)


class Reporter:
    def __init__(self, rt: ServiceRuntime) -> None:
        self.rt = rt
        reg = rt.registry
        self.refused_jobs: dict[str, str] = {}  # job -> why this pool does not serve it (or its versions) now
        self.m_version = Gauge("burstrl_rollout_policy_version", "Version serving new requests", ["job"], registry=reg)
        self.m_adapters = Gauge("burstrl_rollout_adapters_loaded", "Adapters in the engine", ["job"], registry=reg)
        self.m_adopt = Histogram(
            "burstrl_rollout_adopt_seconds",
            "Publish (manifest written) -> adopt (verified, serving) latency",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=reg,
        )
        self.m_adopt_last = Gauge(
            "burstrl_rollout_adopt_last_seconds", "Latest publish -> adopt", ["job"], registry=reg
        )
        self.m_verify_fail = Counter(
            "burstrl_rollout_verify_failures", "Refused policy versions", ["job", "kind"], registry=reg
        )
        self.m_job_refused = Gauge(
            "burstrl_rollout_job_refused",
            "1 while this pool cannot serve a job or its versions (full weights need a pool of their own)",
            ["job"],
            registry=reg,
        )

    # -- versions --------------------------------------------------------------------
    def adopted(self, view: ServedJob, manifest: Manifest, worst: float | None) -> None:
        job_id, v = view.id, manifest.version
        adopt_s = time.time() - manifest.created_at
        self.m_adopt.observe(adopt_s)
        self.m_adopt_last.labels(job_id).set(adopt_s)
        self.rt.health.set(f"policy:{job_id}", True, scope="job")
        try:  # the switch is done; a Redis outage must not undo it, only lose this report
            self._set_job_error(job_id, "")
            record_point(
                self.rt.redis,
                job_id,
                "rollout_version",
                {"event": "adopted", "version": v, "adopt_s": round(adopt_s, 3), "probe_mean_diff": worst},
            )
        except redis.RedisError as e:
            log.warning("job %s: adopted v%d but could not record it: %s", job_id, v, e)
        log.info("job %s: adopted policy v%d (%.2fs after publish, probe diff %s)", job_id, v, adopt_s, worst)

    def refused(self, view: ServedJob, v: int, kind: str, reason: str) -> None:
        job_id = view.id
        self.m_verify_fail.labels(job_id, kind).inc()
        msg = f"policy v{v} refused ({kind}): {reason}; still serving v{view.version}"
        self.rt.health.set(f"policy:{job_id}", False, msg, scope="job")
        record_point(
            self.rt.redis,
            job_id,
            "rollout_version",
            {"event": "refused", "version": v, "kind": kind, "reason": reason, "serving": view.version},
        )
        self._set_job_error(job_id, JOB_ERROR_PREFIX + msg)
        log.error("job %s: %s", job_id, msg)

    # -- jobs ------------------------------------------------------------------------
    def job_refused(self, job_id: str, reason: str) -> None:
        """This pool does not serve `job_id` (or its full-weight versions) now: say so everywhere."""
        if self.refused_jobs.get(job_id) == reason:
            return
        self.refused_jobs[job_id] = reason
        self.m_job_refused.labels(job_id).set(1)
        self.rt.health.set(f"policy:{job_id}", False, reason, scope="job")
        self._set_job_error(job_id, JOB_ERROR_PREFIX + reason)
        log.error("job %s: %s", job_id, reason)

    def job_accepted(self, job_id: str) -> None:
        if self.refused_jobs.pop(job_id, None) is None:
            return
        self.m_job_refused.labels(job_id).set(0)
        self.rt.health.set(f"policy:{job_id}", True, scope="job")
        self._set_job_error(job_id, "")
        log.info("job %s: served by this rollout pool again", job_id)

    def unserved(self, job_id: str) -> None:
        """This pool stopped serving the job (it ended, or is refused now): forget its version gauges."""
        if job_id not in self.refused_jobs:  # a refused job keeps its reason in /readyz
            self.rt.health.set(f"policy:{job_id}", True, "job no longer served", scope="job")
        _remove(job_id, self.m_version, self.m_adapters, self.m_adopt_last)

    def ended(self, job_id: str) -> None:
        """A job this pool refused has ended: forget the refusal."""
        if self.refused_jobs.pop(job_id, None) is None:
            return
        self.rt.health.set(f"policy:{job_id}", True, "job no longer served", scope="job")
        _remove(job_id, self.m_job_refused)

    def served(self, jobs: dict[str, ServedJob]) -> None:
        """The versions and adapters each served job has now (gauges and the heartbeat)."""
        for job_id, view in jobs.items():
            self.m_version.labels(job_id).set(view.version)
            self.m_adapters.labels(job_id).set(view.loaded_adapters())
        self.rt.gauges["policy_versions"] = {j: v.version for j, v in jobs.items()}

    def _set_job_error(self, job_id: str, error: str) -> None:
        """Show a refusal on the job record (GET /v1/jobs/{id}); clear only errors we set."""

        def change(rec: JobRecord) -> bool:
            if rec.error == error or (not error and not rec.error.startswith(JOB_ERROR_PREFIX)):
                return False
            rec.error = error
            return True

        update_job(self.rt.redis, job_id, change)


def _remove(job_id: str, *gauges: Gauge) -> None:
    for g in gauges:
        try:
            g.remove(job_id)
        except KeyError:  # never set for this job
            pass
