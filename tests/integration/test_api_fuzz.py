"""The api against its own OpenAPI document (schemathesis): no input may produce a 5xx.
And every route but health, metrics and the dashboard's static files needs the token.

In-process ASGI over a real redis-server, so handlers hit real Redis behaviour.
"""

from __future__ import annotations

import os
import re

import hypothesis
import pytest
import schemathesis
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from starlette.routing import Mount, Route

from services.api.app import PUBLIC_PATHS, build_routes
from services.api.settings import ApiSettings
from shared.service import ServiceRuntime

TOKEN = "fuzz-test-token-0123456789abcdef"
# The Tinker API (/api/v1, docs/tinker.md) authenticates the tinker SDK's way, the rest by bearer token.
AUTH = {"Authorization": f"Bearer {TOKEN}", "X-API-Key": f"tml-{TOKEN}"}
# Per operation and mode. Small by default (2 shared cores in CI); raise it to hunt deeper.
EXAMPLES = int(os.environ.get("BURSTRL_FUZZ_EXAMPLES", "30"))


@pytest.fixture
def app(r, redis_server):
    rt = ServiceRuntime("api", ApiSettings(redis_url=redis_server.url, token=TOKEN))
    # What the running api's worker reports; otherwise /readyz is (rightly) 503.
    rt.health.set("redis", True)
    rt.health.set("feeder", True)
    return build_routes(rt)


def _operations() -> list[tuple[str, str]]:
    """(method, path) of every operation in the schema, for one test id each.

    Built from an app whose Redis is never contacted: only its OpenAPI document is read.
    """
    rt = ServiceRuntime("api", ApiSettings(redis_url="redis://127.0.0.1:1/0", token=TOKEN))
    doc = build_routes(rt).openapi()
    return [(m.upper(), path) for path, ops in doc["paths"].items() for m in ops]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize(("method", "path"), _operations())
def test_no_server_errors(app, method, path, mode):
    # Plain hypothesis over schemathesis strategies: its lazy pytest fixture loader does
    # not work with this pytest version.
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    op = schema[path][method]
    seen: list[int] = []

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples every run: a failure reproduces
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call(headers=AUTH)
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    try:
        fuzz()
    except hypothesis.errors.Unsatisfiable:
        # No invalid input exists for this operation (no body, no constrained parameter).
        assert mode == GenerationMode.NEGATIVE
    assert not seen or max(seen) < 500


def test_schema_covers_every_v1_route(app):
    """The fuzzer only reaches what the schema lists: make sure that is every /v1 route."""
    doc = TestClient(app).get("/openapi.json", headers=AUTH).json()
    listed = {(path, m.upper()) for path, ops in doc["paths"].items() for m in ops}
    routed = {
        (r.path, m)
        for r in app.routes
        if isinstance(r, APIRoute) and r.path.startswith("/v1/")
        for m in r.methods - {"HEAD"}
    }
    assert routed <= listed


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_route_but_health_and_static_needs_the_token(app):
    client = TestClient(app)
    checked, public = [], []
    for route in app.routes:
        if isinstance(route, Mount):
            assert route.path in PUBLIC_PATHS, f"unexpected mount {route.path}"  # static files only
            continue
        assert isinstance(route, Route)  # APIRoute subclasses Route
        for method in sorted(route.methods - {"HEAD"}):
            if route.path in PUBLIC_PATHS:
                public.append(route.path)
                continue
            url = _concrete(route.path)
            if route.path.startswith("/api/v1/"):  # the Tinker API: the SDK's X-API-Key, `tml-` + the token
                wrong = (
                    {},
                    {"X-API-Key": TOKEN},
                    {"X-API-Key": "tml-wrong-token"},
                    {"Authorization": f"Bearer {TOKEN}"},
                )
                for headers in wrong:
                    resp = client.request(method, url, headers=headers, json={})
                    assert resp.status_code == 401 and "X-API-Key" in resp.text, (
                        method,
                        url,
                        headers,
                        resp.status_code,
                    )
                checked.append((method, route.path))
                continue
            for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}):
                resp = client.request(method, url, headers=headers, json={})
                assert resp.status_code == 401, (method, url, headers, resp.status_code)
                assert resp.headers.get("www-authenticate") == "Bearer"
            checked.append((method, route.path))
    assert ("GET", "/openapi.json") in checked and ("POST", "/v1/jobs") in checked
    assert len(checked) >= 10
    # The public ones answer without a token (and hold no job data).
    for path in set(public) - {"/readyz"}:  # /readyz is 503 until the worker reports
        assert client.get(path).status_code == 200, path
    assert client.get("/dashboard/static/vendor/uPlot.iife.min.js").status_code == 200
    assert client.get("/dashboard/static/vendor/uPlot.LICENSE").status_code == 200
