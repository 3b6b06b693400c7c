"""Jobs the object store holds but Redis lost: list them, register them again."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from services.api import recovery
from services.api.deps import MaybeStore, Redis

router = APIRouter(prefix="/v1/orphans", tags=["jobs"])


@router.get("")
def orphans(r: Redis, store: MaybeStore) -> list[dict[str, Any]]:
    """Jobs the object store holds but Redis does not know (Redis lost them): recoverable or not, and why."""
    return [asdict(o) for o in recovery.orphaned_jobs(r, store)] if store is not None else []


@router.post("/recover")
def recover(
    r: Redis, store: MaybeStore, job: Annotated[list[str] | None, Query(max_length=1000)] = None
) -> dict[str, list[str]]:
    """Register orphaned jobs again from the store (all recoverable ones, or those named by `job`)."""
    if store is None:
        raise HTTPException(409, "this api has no object store configured (STORE_URL)")
    return {"recovered": recovery.recover_jobs(r, store, job)}
