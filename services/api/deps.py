"""What the api's handlers take from the app: its Redis and its object store (`app.state`,
set by the app factory in services/api/app.py), as `Annotated` dependencies."""

from __future__ import annotations

from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request

from shared.store import ObjectStore


def _redis(request: Request) -> redis.Redis:
    return request.app.state.redis


def _store(request: Request) -> ObjectStore | None:
    return request.app.state.store


Redis = Annotated[redis.Redis, Depends(_redis)]
# None when the api runs without STORE_URL (tests, a Redis-only deployment).
MaybeStore = Annotated[ObjectStore | None, Depends(_store)]


def not_found(job_id: str) -> HTTPException:
    return HTTPException(404, f"no job {job_id!r}")


NOT_FOUND = {404: {"description": "No such job"}}
