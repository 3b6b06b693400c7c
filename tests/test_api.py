"""The api's HTTP surface and feeder, in-process over a real Redis."""

import pytest
from fastapi.testclient import TestClient

from services.api.app import build_routes
from services.api.feeder import Feeder
from services.api.settings import ApiSettings
from shared import keys
from shared.metrics import read_ledger
from shared.service import ServiceRuntime

TOKEN = "s3cr3t-token-for-tests-0123"


@pytest.fixture
def client(r, redis_server):
    rt = ServiceRuntime("api", ApiSettings(redis_url=redis_server.url, token=TOKEN))
    build_routes(rt)
    with TestClient(rt.app) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c


def test_bad_spec_gets_422_naming_the_field(client):
    resp = client.post("/v1/jobs", json={"base_model": "m", "group_size": 1})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"][-1] == "group_size"
    resp = client.post("/v1/jobs", json={"group_size": 4})
    assert resp.json()["detail"][0]["loc"][-1] == "base_model"


def test_auth_required_except_health(client):
    bare = TestClient(client.app)
    assert bare.get("/v1/jobs").status_code == 401
    assert bare.get("/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert bare.get("/healthz").status_code == 200
    assert bare.get("/metrics").status_code == 200


def test_placeholder_token_refused_outside_dev():
    with pytest.raises(ValueError, match="BURSTRL_TOKEN"):
        ApiSettings(token="changeme")
    with pytest.raises(ValueError, match="loopback"):
        ApiSettings(dev=True, host="0.0.0.0")


def test_job_lifecycle_and_feeder_window(client, r):
    job = client.post("/v1/jobs", json={"base_model": "m", "batch_size": 4, "max_staleness": 1}).json()
    assert job["state"] == "running"
    Feeder(r).tick()
    assert r.xlen(keys.prompts(job["id"])) == 8  # (max_staleness + 1) x batch
    Feeder(r).tick()
    assert r.xlen(keys.prompts(job["id"])) == 8  # window full: nothing more
    r.hincrby(keys.ledger(job["id"]), "trained", 4)
    Feeder(r).tick()  # a fresh feeder (an api restart) resumes from the durable position
    assert r.xlen(keys.prompts(job["id"])) == 12
    assert read_ledger(r, job["id"])["in_flight"] == 8
    status = client.get(f"/v1/jobs/{job['id']}").json()
    assert status["policy_version"] == 0 and status["ledger"]["fed"] == 12
    assert client.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
    assert client.post(f"/v1/jobs/{job['id']}/resume").status_code == 409
    assert client.get("/v1/jobs/nope").status_code == 404


def test_same_model_resolves_local_paths(tmp_path, monkeypatch):
    from shared.job import same_model

    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert same_model("m", str(tmp_path / "m"))
    assert same_model("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B")
    assert not same_model("m", "Qwen/Qwen2.5-0.5B")
