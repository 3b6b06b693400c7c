"""The service registry: every replica whose heartbeat is live."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.api import overview
from services.api.deps import Redis

router = APIRouter(prefix="/v1/services", tags=["services"])


@router.get("")
def services(r: Redis) -> list[dict[str, Any]]:
    return overview.list_services(r)
