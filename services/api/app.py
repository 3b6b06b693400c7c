"""The api's HTTP surface: thin routers over services/api/jobs.py and overview.py."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Query, Response
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from services.api import bursts, http_limits, jobs, overview, recovery
from services.api.checks import SpecProblem
from services.api.tinker import routes as tinker_routes
from shared import keys
from shared.backlog import budget_problem
from shared.domain.envs import load_env_plugins
from shared.domain.verifiers import load_plugins
from shared.job import JobRecord, JobSpec, UnreadableJob
from shared.metrics import read_points
from shared.service import ServiceRuntime
from shared.store import ObjectStore

STATIC = Path(__file__).resolve().parent / "static"
# Paths served without a token: liveness/readiness/Prometheus (scrapers and probes carry
# no secrets) and the dashboard's static files (the page holds no data; every JSON
# endpoint it calls stays authenticated). tests/integration/test_api_fuzz.py checks every other route.
PUBLIC_PATHS = {"/healthz", "/readyz", "/metrics", "/", "/dashboard", "/dashboard/static"}
# A Redis stream id, the cursor of /v1/jobs/{id}/metrics?after=...
STREAM_ID = r"^\d{1,20}-\d{1,20}$"
# The page is ours and self-contained: scripts and styles only from the api itself.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


# Ids of unreadable job records, on GET /v1/jobs (which lists only the readable ones).
UNREADABLE_HEADER = "X-Burstrl-Unreadable-Jobs"
UNREADABLE_HEADER_MAX = 50  # ids listed in the header; /v1/dashboard has them all, with reasons
NOT_FOUND = {404: {"description": "No such job"}}
UNREADABLE = {409: {"description": "The job's stored record is unreadable (DELETE /v1/jobs/{job_id} removes it)"}}


def _not_found(job_id: str) -> HTTPException:
    return HTTPException(404, f"no job {job_id!r}")


def _unreadable(job_id: str, e: UnreadableJob) -> HTTPException:
    return HTTPException(409, f"{e}; no stage serves it; DELETE /v1/jobs/{job_id} removes it")


def build_routes(rt: ServiceRuntime, store: ObjectStore | None = None) -> FastAPI:
    r = rt.redis
    settings = rt.settings
    # Jobs may name plugin verifiers, tasks and environments: load what the services load.
    load_plugins(getattr(settings, "reward_plugin_modules", []))
    load_env_plugins(getattr(settings, "env_plugin_modules", []))
    router = APIRouter(prefix="/v1", dependencies=[rt.auth])

    @router.get("/orphans", tags=["jobs"])
    def orphans() -> list[dict[str, Any]]:
        """Jobs the object store holds but Redis does not know (Redis lost them): recoverable or not, and why."""
        return [asdict(o) for o in recovery.orphaned_jobs(r, store)] if store is not None else []

    @router.post("/orphans/recover", tags=["jobs"])
    def recover(job: Annotated[list[str] | None, Query(max_length=1000)] = None) -> dict[str, list[str]]:
        """Register orphaned jobs again from the store (all recoverable ones, or those named by `job`)."""
        if store is None:
            raise HTTPException(409, "this api has no object store configured (STORE_URL)")
        return {"recovered": recovery.recover_jobs(r, store, job)}

    @router.post(
        "/jobs",
        status_code=201,
        tags=["jobs"],
        responses={413: {"description": "Body too large"}, 422: {"description": "Invalid spec"}},
    )
    def create_job(spec: JobSpec) -> JobRecord:
        """Submit a job. Besides the spec's own ranges, it is checked against what is registered
        (task, verifiers and their args, environment), its prompt source (read here) and the
        context of the rollout replicas serving its base model: a 422 names the field."""
        if spec.tinker:
            raise HTTPException(
                422,
                [
                    {
                        "type": "value_error",
                        "loc": ["body", "tinker"],
                        "msg": "Tinker models are "
                        "created through the Tinker API (POST /api/v1/create_model, docs/tinker.md)",
                    }
                ],
            )
        if store is not None and (why := budget_problem(spec, store)):  # a budget this deployment cannot hold
            raise HTTPException(422, [{"type": "value_error", "loc": ["body", "backlog", "max_bytes"], "msg": why}])
        try:
            rec = jobs.create_job(r, spec=spec)
        except SpecProblem as e:
            raise HTTPException(422, e.detail()) from None
        if store is not None:  # the copy recovery needs, should Redis ever lose the job
            recovery.save_job_copy(store, rec)
        return rec

    @router.get(
        "/jobs",
        tags=["jobs"],
        responses={
            200: {
                "headers": {
                    UNREADABLE_HEADER: {
                        "description": f"Comma-separated ids (at most {UNREADABLE_HEADER_MAX}) of stored job "
                        "records that cannot be read and are left out of the list",
                        "schema": {"type": "string"},
                    }
                }
            }
        },
    )
    def list_jobs(response: Response) -> list[JobRecord]:
        """Every readable job, oldest first; unreadable records are named in a header, not listed."""
        recs, unreadable = jobs.read_jobs(r)
        if unreadable:
            response.headers[UNREADABLE_HEADER] = ",".join(sorted(unreadable)[:UNREADABLE_HEADER_MAX])
        return recs

    @router.get("/jobs/{job_id}", tags=["jobs"], responses={**NOT_FOUND, **UNREADABLE})
    def get_job(job_id: str) -> dict[str, Any]:
        """The job, its policy version, ledger, evaluations, last step, and `warnings` (an unchecked
        rollout context, completions cut off at the length limit)."""
        try:
            return jobs.job_status(r, job_id=job_id)
        except jobs.JobNotFound:
            raise _not_found(job_id) from None
        except UnreadableJob as e:
            raise _unreadable(job_id, e) from None

    @router.delete(
        "/jobs/{job_id}",
        tags=["jobs"],
        responses={**NOT_FOUND, 409: {"description": "The job is pending, running or paused, or a trainer holds it"}},
    )
    def delete_job(
        job_id: str,
        purge_store: Annotated[
            bool, Query(description="Also delete the job's policy versions and checkpoints from the object store.")
        ] = False,
    ) -> dict[str, Any]:
        """Delete a job that is not live (cancel it first): every Redis key of it. Its artifacts in
        the object store (policy versions, checkpoints) are kept, marked deleted on purpose (so
        they are not listed as orphans), unless `purge_store=true`. An unreadable record can
        always be deleted."""
        if purge_store and store is None:
            raise HTTPException(409, "this api has no object store configured (STORE_URL): nothing to purge")
        try:
            return jobs.delete_job(r, job_id=job_id, store=store, purge_store=purge_store)
        except jobs.JobNotFound:
            raise _not_found(job_id) from None
        except jobs.BadTransition as e:
            raise HTTPException(409, str(e)) from None

    @router.get("/jobs/{job_id}/metrics", tags=["jobs"], responses={404: {"description": "No such job"}})
    def job_metrics(
        job_id: str,
        source: str | None = None,
        after: Annotated[
            str | None, Query(pattern=STREAM_ID, description="Only points after this cursor (a point's `id`).")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 100_000,
    ) -> list[dict[str, Any]]:
        """The job's metric points, oldest first; each carries `id`, the cursor for `after`."""
        if not r.hexists(keys.jobs_index(), job_id):
            raise _not_found(job_id)
        return read_points(r, job_id, source, after=after, limit=limit, with_ids=True)

    @router.get("/jobs/{job_id}/bursts", tags=["jobs"], responses=NOT_FOUND)
    def job_bursts(
        job_id: str,
        limit: Annotated[
            int, Query(ge=1, le=bursts.MAX_SESSIONS, description="The newest sessions to return, oldest first.")
        ] = 200,
    ) -> dict[str, Any]:
        """The burst timeline: each trainer session on the job (when it held the job, billable
        seconds from its process start, steps, groups, the lag of the data it trained on), and totals."""
        if not r.hexists(keys.jobs_index(), job_id):
            raise _not_found(job_id)
        return bursts.burst_timeline(r, job_id, limit=limit)

    def _action(action: str) -> None:
        @router.post(
            f"/jobs/{{job_id}}/{action}",
            tags=["jobs"],
            name=f"{action}_job",
            responses={**NOT_FOUND, 409: {"description": "Not allowed in this state, or the record is unreadable"}},
        )
        def act(job_id: str) -> JobRecord:
            try:
                return jobs.transition(r, job_id=job_id, action=action)
            except jobs.JobNotFound:
                raise _not_found(job_id) from None
            except jobs.BadTransition as e:
                raise HTTPException(409, str(e)) from None
            except UnreadableJob as e:
                raise _unreadable(job_id, e) from None

    for a in ("cancel", "pause", "resume"):
        _action(a)

    @router.get("/services", tags=["services"])
    def services() -> list[dict[str, Any]]:
        return overview.list_services(r)

    @router.get("/dashboard", tags=["dashboard"])
    def dashboard_data() -> dict[str, Any]:
        """Services, and per job: queues, ledger, policy pointer and its adoption by replicas;
        `unreadable`: job id -> why its stored record cannot be read (those jobs are not served)."""
        recs, unreadable = jobs.read_jobs(r)
        return {**overview.overview(r, sorted(recs, key=lambda j: -j.created_at)), "unreadable": unreadable}

    http_limits.install(rt.app)
    rt.app.include_router(router)
    tinker_routes.install(rt)  # the Tinker API, under /api/v1 (docs/tinker.md)
    _protect_openapi(rt)
    _mount_dashboard(rt.app)
    return rt.app


def _protect_openapi(rt: ServiceRuntime) -> None:
    """Serve the OpenAPI document behind the token, like every other non-health route.

    FastAPI adds /openapi.json, /docs and /redoc without any dependency. The docs pages
    load Swagger/ReDoc from a CDN, which offline machines cannot reach, and would need
    the schema without a token, so they are dropped; the schema stays available.
    """
    auto = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    rt.app.router.routes[:] = [rt_ for rt_ in rt.app.router.routes if getattr(rt_, "path", None) not in auto]
    app = rt.app

    @app.get("/openapi.json", include_in_schema=False, dependencies=[rt.auth])
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())


def _mount_dashboard(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard", include_in_schema=False)
    def dashboard_page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
