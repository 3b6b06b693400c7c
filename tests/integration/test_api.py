"""The api's HTTP surface and feeder, in-process over a real Redis."""

import pytest
from fastapi.testclient import TestClient

from services.api.feeder import Feeder
from services.api.settings import ApiSettings
from shared import keys
from shared.metrics import read_ledger
from tests.support.api import api_client

TOKEN = "s3cr3t-token-for-tests-0123"


@pytest.fixture
def client(r, redis_server):
    with api_client(redis_server.url, TOKEN) as c:
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


def test_unknown_task_gets_422_naming_the_field(client):
    resp = client.post("/v1/jobs", json={"base_model": "m", "task": "no-such-task"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "task"]
    assert "no-such-task" in resp.json()["detail"][0]["msg"]


def test_metrics_cursor_returns_only_newer_points(client, r):
    from shared.metrics import record_point

    job = client.post("/v1/jobs", json={"base_model": "m"}).json()
    for step in range(3):
        record_point(r, job["id"], "trainer", {"step": step})
    record_point(r, job["id"], "rollout", {"groups": 1})
    every = client.get(f"/v1/jobs/{job['id']}/metrics").json()
    assert [p["source"] for p in every] == ["trainer"] * 3 + ["rollout"]
    newer = client.get(f"/v1/jobs/{job['id']}/metrics", params={"after": every[0]["id"]}).json()
    assert newer == every[1:]
    trainer = client.get(f"/v1/jobs/{job['id']}/metrics", params={"after": every[0]["id"], "source": "trainer"})
    assert [p["step"] for p in trainer.json()] == [1, 2]
    assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 2}).json() == every[:2]
    assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"after": "not-an-id"}).status_code == 422


def test_services_registry_skips_corrupt_heartbeats(client, r):
    good = '{"role": "reward", "replica": "r0", "host": "h", "port": 1, "version": "0", "ready": true, "at": 1}'
    r.set(keys.service("reward", "r0"), good)
    r.set(keys.service("reward", "junk"), "not json")
    r.set(keys.service("reward", "partial"), '{"role": "reward", "replica": "partial", "ready": true, "at": 1}')
    assert [s["replica"] for s in client.get("/v1/services").json()] == ["r0"]


def test_up_config_env_tables_yield_to_the_environment(monkeypatch):
    from services.cli.stack import role_env

    conf = {
        "env": {"common": {"BURSTRL_HEARTBEAT_S": 1.5}, "rollout": {"BURSTRL_ROLLOUT_MAX_LORAS": 3, "X_FLAG": True}}
    }
    monkeypatch.setenv("BURSTRL_HEARTBEAT_S", "4")
    assert role_env(conf, "rollout", model_given=False) == {"BURSTRL_ROLLOUT_MAX_LORAS": "3", "X_FLAG": "1"}
    assert role_env(conf, "reward", model_given=False) == {}
    model = {"env": {"ref": {"BURSTRL_REF_MODEL": "Qwen/Qwen3-0.6B"}}}
    assert role_env(model, "ref", model_given=True) == {}
    assert role_env(None, "api", model_given=False) == {}


def test_config_files_submit_as_job_specs():
    """`burstrl submit configs/...toml` posts the file minus its non-job tables."""
    import tomllib
    from pathlib import Path

    from services.cli.main import NOT_JOB_TABLES
    from shared.job import JobSpec

    files = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*/*.toml"))
    for f in files:
        spec = tomllib.loads(f.read_text())
        for table in NOT_JOB_TABLES:
            spec.pop(table, None)
        JobSpec(**spec)  # raises on a field the api would refuse
