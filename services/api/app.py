"""The api's HTTP surface: thin routers over services/api/jobs.py."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException

from services.api import jobs
from shared import keys
from shared.job import JobRecord, JobSpec
from shared.metrics import read_points
from shared.service import ServiceRuntime


def build_routes(rt: ServiceRuntime) -> FastAPI:
    r = rt.redis
    router = APIRouter(prefix="/v1", dependencies=[rt.auth])

    @router.post("/jobs", status_code=201, tags=["jobs"])
    def create_job(spec: JobSpec) -> JobRecord:
        return jobs.create_job(r, spec=spec)

    @router.get("/jobs", tags=["jobs"])
    def list_jobs() -> list[JobRecord]:
        return jobs.list_jobs(r)

    @router.get("/jobs/{job_id}", tags=["jobs"])
    def get_job(job_id: str) -> dict[str, Any]:
        try:
            return jobs.job_status(r, job_id=job_id)
        except jobs.JobNotFound:
            raise HTTPException(404, f"no job {job_id!r}") from None

    @router.get("/jobs/{job_id}/metrics", tags=["jobs"])
    def job_metrics(job_id: str, source: str | None = None) -> list[dict[str, Any]]:
        if not r.hexists(keys.jobs_index(), job_id):
            raise HTTPException(404, f"no job {job_id!r}")
        return read_points(r, job_id, source)

    def _action(action: str) -> None:
        @router.post(f"/jobs/{{job_id}}/{action}", tags=["jobs"], name=f"{action}_job")
        def act(job_id: str) -> JobRecord:
            try:
                return jobs.transition(r, job_id=job_id, action=action)
            except jobs.JobNotFound:
                raise HTTPException(404, f"no job {job_id!r}") from None
            except jobs.BadTransition as e:
                raise HTTPException(409, str(e)) from None

    for a in ("cancel", "pause", "resume"):
        _action(a)

    @router.get("/services", tags=["services"])
    def services() -> list[dict[str, Any]]:
        out = []
        for key in r.scan_iter(match=keys.service_pattern(), count=200):
            raw = r.get(key)
            if raw:
                beat = json.loads(raw)
                beat["age_s"] = round(time.time() - beat.get("at", 0), 1)
                out.append(beat)
        return sorted(out, key=lambda b: (b["role"], b["replica"]))

    rt.app.include_router(router)
    return rt.app
