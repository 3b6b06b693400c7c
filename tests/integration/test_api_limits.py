"""Issue 18, items 12-14: no accepted value can break the api for everyone.

Every number finite and bounded, every string, list and mapping length-bounded (checked
on the JSON schema the api serves, so a field added later without a bound fails here),
a body-size limit enforced before parsing, 422s that never echo a large input, and
unreadable records skipped and reported. HTTP tests run against the real api app over a
real Redis.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.job import JobSpec
from shared.limits import SEED_MAX
from tests.support.api import api_client
from tests.support.api import served as serve


def _walk(schema: dict[str, Any], defs: dict[str, Any], path: str, seen: set[str]) -> list[str]:
    """Paths of the schema's leaves that lack a bound (numbers, strings, arrays, objects)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        if name in seen:
            return []
        return _walk(defs[name], defs, path, seen | {name})
    out: list[str] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key, [])):
            out += _walk(sub, defs, f"{path}|{i}", seen)
    kind = schema.get("type")
    if "enum" in schema or "const" in schema or kind in ("boolean", "null"):
        return out
    if kind in ("integer", "number"):
        lo = "minimum" in schema or "exclusiveMinimum" in schema
        hi = "maximum" in schema or "exclusiveMaximum" in schema
        if not (lo and hi):
            out.append(f"{path}: {kind} without both bounds")
    elif kind == "string":
        if "maxLength" not in schema:
            out.append(f"{path}: string without maxLength")
    elif kind == "array":
        if "maxItems" not in schema:
            out.append(f"{path}: array without maxItems")
        out += _walk(schema.get("items", {}), defs, f"{path}[]", seen)
    elif kind == "object":
        for name, sub in schema.get("properties", {}).items():
            out += _walk(sub, defs, f"{path}.{name}", seen)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            if "maxProperties" not in schema:
                out.append(f"{path}: mapping without maxProperties")
            if "maxLength" not in schema.get("propertyNames", {}):
                out.append(f"{path}: mapping keys without maxLength")
            out += _walk(extra, defs, f"{path}{{}}", seen)
    return out


def test_every_field_of_the_spec_is_bounded():
    schema = JobSpec.model_json_schema()
    assert _walk(schema, schema.get("$defs", {}), "JobSpec", set()) == []


def test_seed_is_bounded_where_every_seeder_takes_it():
    JobSpec(base_model="m", seed=SEED_MAX)
    with pytest.raises(ValueError, match="seed"):
        JobSpec(base_model="m", seed=2**200)


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize(
    "where",
    [
        '"tis_cap": {}',
        '"learning_rate": {}',
        '"seed": {}',
        '"sampling": {{"temperature": {}}}',
        '"algorithm": {{"entropy_coef": {}}}',
        '"env": {{"max_seconds": {}}}',
        '"task_spec": {{"timeout_s": {}}}',
        '"task_spec": {{"verifiers": [{{"name": "exact", "weight": {}}}]}}',
        '"task_spec": {{"verifiers": [{{"name": "overlong", "args": {{"cache": {}}}}}]}}',
        '"task_spec": {{"verifiers": [{{"name": "overlong", "args": {{"cache": [1, {}]}}}}]}}',
        '"env": {{"name": "calc", "args": {{"x": {}}}}}',
    ],
)
def test_non_finite_numbers_are_refused_everywhere(where, literal):
    body = json.loads('{"base_model": "m", ' + where.format(literal) + "}")  # Python's parser takes them
    with pytest.raises(ValueError, match="finite|valid"):
        JobSpec.model_validate(body)


# -- over HTTP ---------------------------------------------------------------------------
@pytest.fixture
def client(r, redis_server):
    with api_client(redis_server.url, TOKEN) as c:
        yield c


TOKEN = "limits-test-token-0123456789"


def _post_raw(client, text: str):
    return client.post("/v1/jobs", content=text.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ('{"name": "x", "base_model": "m", "tis_cap": Infinity}', ["body", "tis_cap"]),
        ('{"base_model": "m", "learning_rate": NaN}', ["body", "learning_rate"]),
        ('{"base_model": "m", "sampling": {"top_p": -Infinity}}', ["body", "sampling", "top_p"]),
        ('{"base_model": "m", "algorithm": {"mismatch_min": NaN}}', ["body", "algorithm", "mismatch_min"]),
        ('{"base_model": "m", "seed": Infinity}', ["body", "seed"]),
    ],
)
def test_non_finite_numbers_get_a_422_naming_the_field(client, body, loc):
    resp = _post_raw(client, body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == loc
    # The 422 itself is valid JSON (it used to be a 500), and the api keeps serving.
    assert client.get("/v1/jobs").status_code == 200
    assert client.post("/v1/jobs", json={"base_model": "m"}).status_code == 201


def test_huge_integers_get_a_422(client):
    resp = client.post("/v1/jobs", json={"base_model": "m", "seed": 2**200})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "seed"]


def test_422s_do_not_echo_large_inputs(client):
    big = "v" * 500_000  # under the body limit, far over the field's
    resp = client.post("/v1/jobs", json={"base_model": "m", "verifier": big})
    assert resp.status_code == 422
    (err,) = resp.json()["detail"]
    assert err["loc"] == ["body", "verifier"]
    assert len(resp.content) < 2000
    assert "500000 characters" in err["input"]


def test_unreadable_record_never_breaks_the_others(client, r):
    from services.api.feeder import Feeder
    from shared import keys

    good = client.post("/v1/jobs", json={"name": "good", "base_model": "m", "eval_size": 0}).json()["id"]
    # What the api itself once stored for `"tis_cap": Infinity`: null, which no reader accepts.
    bad_rec = json.loads(r.hget(keys.jobs_index(), good))
    bad_rec.update(id="bad-000000", spec={**bad_rec["spec"], "name": "bad", "tis_cap": None})
    r.hset(keys.jobs_index(), "bad-000000", json.dumps(bad_rec))
    r.sadd(keys.active_jobs(), "bad-000000")

    listing = client.get("/v1/jobs")
    assert listing.status_code == 200
    assert [j["id"] for j in listing.json()] == [good]
    assert listing.headers["x-burstrl-unreadable-jobs"] == "bad-000000"
    dash = client.get("/v1/dashboard")
    assert dash.status_code == 200
    assert [j["id"] for j in dash.json()["jobs"]] == [good]
    assert "tis_cap" in dash.json()["unreadable"]["bad-000000"]
    assert client.get(f"/v1/jobs/{good}").status_code == 200
    bad = client.get("/v1/jobs/bad-000000")
    assert bad.status_code == 409 and "unreadable" in bad.json()["detail"]
    assert client.post("/v1/jobs/bad-000000/cancel").status_code == 409
    Feeder(r).tick()  # feeds the good job, skips the bad one
    assert r.xlen(keys.prompts(good)) > 0 and r.xlen(keys.prompts("bad-000000")) == 0
    assert client.post(f"/v1/jobs/{good}/cancel").json()["state"] == "cancelled"
    # The way out: an unreadable record can always be deleted.
    assert client.delete("/v1/jobs/bad-000000").status_code == 200
    assert "x-burstrl-unreadable-jobs" not in client.get("/v1/jobs").headers
    assert client.get("/v1/jobs/bad-000000").status_code == 404


def test_declared_body_over_the_limit_is_refused_unread(client):
    from shared.limits import BODY_MAX_BYTES

    body = json.dumps({"base_model": "m", "verifier": "v" * (BODY_MAX_BYTES + 10)}).encode()
    resp = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert "larger than" in resp.json()["detail"]
    assert len(resp.content) < 500


def test_streamed_body_over_the_limit_is_refused(client):
    """No Content-Length (chunked): counted as it arrives."""

    def chunks():
        yield b'{"base_model": "m", "verifier": "'
        for _ in range(12):
            yield b"v" * (256 * 1024)
        yield b'"}'

    resp = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413


@pytest.fixture
def served(client):
    """The same app on a real uvicorn server on a free port (the api's own HTTP stack)."""
    with serve(client.app) as url:
        yield url


def test_healthz_answers_while_a_10mb_body_is_refused(served):
    """A 10 MB body used to hold the event loop for 14 s and come back whole in the 422."""
    import threading

    import httpx

    halfway, healthz_answered = threading.Event(), threading.Event()
    result: dict[str, httpx.Response] = {}

    def chunks():
        yield b'{"base_model": "m", "verifier": "'
        for i in range(40):  # 40 x 256 KiB = 10 MiB
            if i == 8:  # 2 MiB sent: over the limit, and the upload is still going
                halfway.set()
                assert healthz_answered.wait(30), "/healthz did not answer during the upload"
            yield b"v" * (256 * 1024)
        yield b'"}'

    def upload():
        result["post"] = httpx.post(
            f"{served}/v1/jobs",
            content=chunks(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            timeout=60,
        )

    t = threading.Thread(target=upload)
    t.start()
    assert halfway.wait(30)
    health = httpx.get(f"{served}/healthz", timeout=30)
    healthz_answered.set()
    t.join(60)
    assert health.status_code == 200
    assert result["post"].status_code == 413
    assert len(result["post"].content) < 500
    # The connection and the server are fine afterwards.
    ok = httpx.post(f"{served}/v1/jobs", json={"base_model": "m"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 201


def test_declared_10mb_body_over_real_http_gets_the_413(served):
    """Refused before a byte of the body is read; the client, writing it all first, still gets the answer."""
    import httpx

    body = json.dumps({"base_model": "m", "verifier": "v" * 10_000_000}).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with httpx.Client(base_url=served, headers=headers, timeout=60) as c:
        resp = c.post("/v1/jobs", content=body)
        assert resp.status_code == 413
        assert c.get("/healthz").status_code == 200  # same keep-alive connection


@pytest.mark.parametrize("ref", ["https://example.com/model", "m\nx", "m" * 2000])
def test_model_refs_no_stage_could_load_are_refused(client, ref):
    for field in ("base_model", "teacher"):
        body = {"base_model": "m", field: ref, "kl_coef": 0.1}
        assert client.post("/v1/jobs", json=body).json()["detail"][0]["loc"] == ["body", field]
