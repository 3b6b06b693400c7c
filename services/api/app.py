"""The api's app factory: its state, its routers (services/api/routes/, one per feature) behind
the token, the body limit, the OpenAPI document and the dashboard page.

Handlers take what they need from `app.state` through the dependencies in services/api/deps.py;
the domain functions under them (jobs.py, overview.py, bursts.py, recovery.py) know no HTTP.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.api import http_limits
from services.api.routes import ROUTERS
from services.api.routes.dashboard import PAGE_PATHS, STATIC_MOUNT, mount_page
from services.api.tinker import routes as tinker_routes
from shared.domain.envs import load_env_plugins
from shared.domain.verifiers import load_plugins
from shared.service import HEALTH_PATHS, ServiceRuntime
from shared.store import ObjectStore

# Paths served without a token: liveness/readiness/Prometheus (scrapers and probes carry
# no secrets) and the dashboard's page and static files (the page holds no data; every JSON
# endpoint it calls stays authenticated). tests/integration/test_api_fuzz.py checks every other route.
PUBLIC_PATHS = {*HEALTH_PATHS, *PAGE_PATHS, STATIC_MOUNT}


def build_routes(rt: ServiceRuntime, store: ObjectStore | None = None) -> FastAPI:
    """The api's app on `rt` (its Redis, settings and token), with the job copies in `store`."""
    settings = rt.settings
    # Jobs may name plugin verifiers, tasks and environments: load what the services load.
    load_plugins(getattr(settings, "reward_plugin_modules", []))
    load_env_plugins(getattr(settings, "env_plugin_modules", []))
    app = rt.app
    app.state.redis = rt.redis
    app.state.store = store
    http_limits.install(app)
    for router in ROUTERS:
        app.include_router(router, dependencies=[rt.auth])
    tinker_routes.install(rt)  # the Tinker API, under /api/v1, with its own key (docs/tinker.md)
    _protect_openapi(rt)
    mount_page(app)
    rt.publish(*PAGE_PATHS, mounts=(STATIC_MOUNT,))
    return app


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
