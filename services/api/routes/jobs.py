"""Jobs: submit, list, read, delete, and the state actions (cancel, pause, resume)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response

from services.api import jobs, pages, recovery
from services.api.checks import SpecProblem
from services.api.deps import NOT_FOUND, MaybeStore, Redis, not_found
from shared.backlog import budget_problem
from shared.job import JobRecord, JobSpec, JobState, JobTaken, UnreadableJob

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

# Ids of unreadable job records, on GET /v1/jobs (which lists only the readable ones).
UNREADABLE_HEADER = "X-Burstrl-Unreadable-Jobs"
UNREADABLE_HEADER_MAX = 50  # ids listed in the header; /v1/dashboard has the active ones, with reasons
PAGE_DEFAULT = 100  # jobs per page of GET /v1/jobs
PAGE_MAX = 1000
UNREADABLE = {409: {"description": "The job's stored record is unreadable (DELETE /v1/jobs/{job_id} removes it)"}}
ACTION_REFUSED = {409: {"description": "Not allowed in this state, or the record is unreadable"}}


def _unreadable(job_id: str, e: UnreadableJob) -> HTTPException:
    return HTTPException(409, f"{e}; no stage serves it; DELETE /v1/jobs/{job_id} removes it")


@router.post(
    "",
    status_code=201,
    responses={
        409: {"description": "Every id drawn for this name was taken"},
        413: {"description": "Body too large"},
        422: {"description": "Invalid spec"},
    },
)
def create_job(r: Redis, store: MaybeStore, spec: JobSpec) -> JobRecord:
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
                    "msg": "Tinker models are created through the Tinker API (POST /api/v1/create_model, docs/tinker.md)",
                }
            ],
        )
    if store is not None and (why := budget_problem(spec, store)):  # a budget this deployment cannot hold
        raise HTTPException(422, [{"type": "value_error", "loc": ["body", "backlog", "max_bytes"], "msg": why}])
    try:
        rec = jobs.create_job(r, spec=spec, store=store)
    except SpecProblem as e:
        raise HTTPException(422, e.detail()) from None
    except JobTaken as e:  # every fresh suffix drawn was taken: the name holds millions of jobs
        raise HTTPException(409, f"{e}: submit it under another name") from None
    if store is not None:  # the copy recovery needs, should Redis ever lose the job
        recovery.save_job_copy(store, rec)
    return rec


@router.get(
    "",
    responses={
        200: {
            "headers": {
                "Link": {
                    "description": 'The next page, when there is one: `<URL>; rel="next"` (RFC 8288), the same '
                    "query with its `cursor`",
                    "schema": {"type": "string"},
                },
                UNREADABLE_HEADER: {
                    "description": f"Comma-separated ids (at most {UNREADABLE_HEADER_MAX}) of stored job "
                    "records on this page that cannot be read and are left out of the list",
                    "schema": {"type": "string"},
                },
            }
        },
        422: {"description": "A bad `state` or `limit`, or a `cursor` this api did not issue for this query"},
    },
)
def list_jobs(
    r: Redis,
    request: Request,
    response: Response,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description="Jobs per page.")] = PAGE_DEFAULT,
    cursor: Annotated[
        str | None,
        Query(
            max_length=pages.CURSOR_MAX,
            description='Where the page starts: the `cursor` of the previous page\'s `Link: <...>; rel="next"`.',
        ),
    ] = None,
) -> list[JobRecord]:
    """The jobs, newest first, a page at a time (follow the `Link` header's `rel="next"`);
    unreadable records are named in a header, not listed."""
    try:
        page = jobs.list_page(r, state=state, limit=limit, cursor=cursor)
    except pages.BadCursor as e:
        raise HTTPException(422, [{"type": "value_error", "loc": ["query", "cursor"], "msg": str(e)}]) from None
    if page.unreadable:
        response.headers[UNREADABLE_HEADER] = ",".join(sorted(page.unreadable)[:UNREADABLE_HEADER_MAX])
    if page.cursor is not None:
        response.headers["Link"] = f'<{request.url.include_query_params(cursor=page.cursor)}>; rel="next"'
    return page.jobs


@router.get("/{job_id}", responses={**NOT_FOUND, **UNREADABLE})
def get_job(r: Redis, job_id: str) -> dict[str, Any]:
    """The job, its policy version, ledger, evaluations, last step, and `warnings` (an unchecked
    rollout context, completions cut off at the length limit)."""
    try:
        return jobs.job_status(r, job_id=job_id)
    except jobs.JobNotFound:
        raise not_found(job_id) from None
    except UnreadableJob as e:
        raise _unreadable(job_id, e) from None


@router.delete(
    "/{job_id}",
    responses={**NOT_FOUND, 409: {"description": "The job is pending, running or paused, or a trainer holds it"}},
)
def delete_job(
    r: Redis,
    store: MaybeStore,
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
        raise not_found(job_id) from None
    except jobs.BadTransition as e:
        raise HTTPException(409, str(e)) from None


def _act(r: Redis, job_id: str, action: str) -> JobRecord:
    try:
        return jobs.transition(r, job_id=job_id, action=action)
    except jobs.JobNotFound:
        raise not_found(job_id) from None
    except jobs.BadTransition as e:
        raise HTTPException(409, str(e)) from None
    except UnreadableJob as e:
        raise _unreadable(job_id, e) from None


@router.post("/{job_id}/cancel", name="cancel_job", responses={**NOT_FOUND, **ACTION_REFUSED})
def cancel(r: Redis, job_id: str) -> JobRecord:
    return _act(r, job_id, "cancel")


@router.post("/{job_id}/pause", name="pause_job", responses={**NOT_FOUND, **ACTION_REFUSED})
def pause(r: Redis, job_id: str) -> JobRecord:
    return _act(r, job_id, "pause")


@router.post("/{job_id}/resume", name="resume_job", responses={**NOT_FOUND, **ACTION_REFUSED})
def resume(r: Redis, job_id: str) -> JobRecord:
    return _act(r, job_id, "resume")
