"""The api's routers, one module per feature, in the order the OpenAPI document lists them.

Each is a thin `APIRouter` over plain domain functions (services/api/jobs.py, overview.py,
bursts.py, recovery.py); services/api/app.py includes every router here behind the token.
A new feature is a module here and one line below.
"""

from __future__ import annotations

from fastapi import APIRouter

from services.api.routes import bursts, dashboard, jobs, metrics, recovery, registry

ROUTERS: tuple[APIRouter, ...] = (
    recovery.router,
    jobs.router,
    metrics.router,
    bursts.router,
    registry.router,
    dashboard.router,
)
