"""A job's burst timeline: the trainer sessions that held it (services/api/bursts.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from services.api import bursts
from services.api.deps import NOT_FOUND, Redis, not_found
from shared import keys

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["jobs"])


@router.get("/bursts", responses=NOT_FOUND)
def job_bursts(
    r: Redis,
    job_id: str,
    limit: Annotated[
        int, Query(ge=1, le=bursts.MAX_SESSIONS, description="The newest sessions to return, oldest first.")
    ] = 200,
) -> dict[str, Any]:
    """The burst timeline: each trainer session on the job (when it held the job, billable
    seconds from its process start, steps, groups, the lag of the data it trained on), and totals."""
    if not r.hexists(keys.jobs_index(), job_id):
        raise not_found(job_id)
    return bursts.burst_timeline(r, job_id=job_id, limit=limit)
