"""A job's metric points (the series the trainer, rollout and reward record)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from services.api.deps import NOT_FOUND, Redis, not_found
from shared import keys
from shared.metrics import read_points

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["jobs"])
# A Redis stream id, the cursor of /v1/jobs/{id}/metrics?after=...
STREAM_ID = r"^\d{1,20}-\d{1,20}$"


@router.get("/metrics", responses=NOT_FOUND)
def job_metrics(
    r: Redis,
    job_id: str,
    source: str | None = None,
    after: Annotated[
        str | None, Query(pattern=STREAM_ID, description="Only points after this cursor (a point's `id`).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 100_000,
) -> list[dict[str, Any]]:
    """The job's metric points, oldest first; each carries `id`, the cursor for `after`."""
    if not r.hexists(keys.jobs_index(), job_id):
        raise not_found(job_id)
    return read_points(r, job_id, source, after=after, limit=limit, with_ids=True)
