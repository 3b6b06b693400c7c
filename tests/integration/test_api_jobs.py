"""Issue 18, items 14, 15, 17, 18: deleting jobs, validation at submission, the rollout's
context, and `burstrl submit --follow` on a job without evaluations.

The real api app (FastAPI's TestClient, or uvicorn over real HTTP) over a real Redis.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shared import keys
from shared.lease import Lease
from shared.metrics import record_eval, record_point
from shared.store import open_store
from tests.support.api import api_client
from tests.support.api import served as serve
from tests.support.heartbeats import fake_heartbeat

TOKEN = "jobs-test-token-0123456789ab"


@pytest.fixture
def store_url(tmp_path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.fixture
def client(r, redis_server, store_url):
    with api_client(redis_server.url, TOKEN, store_url) as c:
        yield c


def _loc(resp) -> list:
    assert resp.status_code == 422, resp.text
    return resp.json()["detail"][0]["loc"]


def _job_keys(r, job_id: str) -> list[bytes]:
    return sorted(k for k in r.scan_iter(count=1000) if job_id.encode() in k)


# -- DELETE /v1/jobs/{id} ------------------------------------------------------------------
def test_delete_removes_every_key_of_the_job_and_keeps_the_store(client, r, store_url):
    from services.api.feeder import Feeder

    job = client.post("/v1/jobs", json={"name": "gone", "base_model": "m", "eval_size": 0}).json()["id"]
    other = client.post("/v1/jobs", json={"name": "stays", "base_model": "m", "eval_size": 0}).json()["id"]
    Feeder(r).tick()  # prompt streams, ledger counts
    for j in (job, other):
        record_point(r, j, "trainer", {"step": 1})
        record_eval(r, j, 1, {"accuracy": 0.5})
        r.set(keys.eval_claim(j, 1), "x")
        r.set(keys.trainer_epoch(j), 3)
    store = open_store(store_url)
    store.put(f"jobs/{job}/policy/v1/manifest.json", b"{}")
    others_before = _job_keys(r, other)
    assert len(_job_keys(r, job)) >= 8

    assert client.delete(f"/v1/jobs/{job}").status_code == 409  # running: cancel first
    client.post(f"/v1/jobs/{job}/cancel")
    resp = client.delete(f"/v1/jobs/{job}")
    assert resp.status_code == 200, resp.text
    assert resp.json()["store_kept"] is True
    assert _job_keys(r, job) == []
    assert not r.hexists(keys.jobs_index(), job) and not r.sismember(keys.active_jobs(), job)
    assert _job_keys(r, other) == others_before  # another job's keys are untouched
    assert store.list(f"jobs/{job}/") == [
        f"jobs/{job}/{f}" for f in ("deleted.json", "job.json", "policy/v1/manifest.json")
    ]
    # Deleted on purpose: its kept artifacts are not taken for a job Redis lost.
    assert client.get("/v1/orphans").json() == []
    assert client.get(f"/v1/jobs/{job}").status_code == 404
    assert client.delete(f"/v1/jobs/{job}").status_code == 404


def test_delete_purges_the_store_only_when_asked_and_waits_for_the_trainer(client, r, store_url):
    job = client.post("/v1/jobs", json={"base_model": "m", "eval_size": 0}).json()["id"]
    store = open_store(store_url)
    store.put(f"jobs/{job}/trainer/step-00000001/state.json", b"{}")
    store.put("jobs/someone-else/policy/v1/manifest.json", b"{}")
    client.post(f"/v1/jobs/{job}/cancel")
    lease = Lease(r, job, "trainer-0", 30.0)
    assert lease.acquire()
    held = client.delete(f"/v1/jobs/{job}", params={"purge_store": True})
    assert held.status_code == 409 and "lease" in held.json()["detail"]
    lease.release()
    resp = client.delete(f"/v1/jobs/{job}", params={"purge_store": True})
    assert resp.status_code == 200 and resp.json()["purged_objects"] == 2  # the checkpoint and the job's copy
    assert store.list(f"jobs/{job}/") == []
    assert job not in {o["job_id"] for o in client.get("/v1/orphans").json()}
    assert store.list("jobs/someone-else/") == ["jobs/someone-else/policy/v1/manifest.json"]


def test_delete_needs_the_token_and_is_documented(client):
    bare = TestClient(client.app)
    assert bare.delete("/v1/jobs/x").status_code == 401
    doc = client.get("/openapi.json").json()
    op = doc["paths"]["/v1/jobs/{job_id}"]["delete"]
    assert {"job_id", "purge_store"} <= {p["name"] for p in op["parameters"]}
    assert {"404", "409"} <= set(op["responses"])


# -- validation at submission --------------------------------------------------------------
def _verifier(name: str, **args) -> dict:
    return {"base_model": "m", "task_spec": {"verifiers": [{"name": name, "args": args}]}}


def test_unknown_names_get_a_422_with_the_choices(client):
    resp = client.post("/v1/jobs", json=_verifier("no-such"))
    assert _loc(resp) == ["body", "task_spec", "verifiers", 0, "name"]
    assert "regex" in resp.json()["detail"][0]["msg"]  # the valid choices
    resp = client.post("/v1/jobs", json={"base_model": "m", "verifier": "no-such"})
    assert _loc(resp) == ["body", "verifier"]
    resp = client.post("/v1/jobs", json={"base_model": "m", "env": {"name": "no-such"}})
    assert _loc(resp) == ["body", "env", "name"]
    assert "calc" in resp.json()["detail"][0]["msg"]
    resp = client.post(
        "/v1/jobs", json={"base_model": "m", "task": "arith3", "env": {"name": "calc", "args": {"nope": 1}}}
    )
    assert _loc(resp) == ["body", "env", "args"]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"pattern": "("}, "pattern"),  # does not compile
        ({"pattern": r"(a)\1"}, "pattern"),  # a backreference: RE2 has none
        ({"pattern": "(?=a)"}, "pattern"),  # lookaround
        ({"pattern": "a", "mode": "sometimes"}, "mode"),
        ({"pattern": "a", "flags": "x"}, "flags"),
        ({"patern": "a"}, "patern"),  # a typo: regex takes no such argument
        ({"pattern": 3}, "pattern"),  # wrong type
    ],
)
def test_bad_regex_args_get_a_422_naming_the_argument(client, args, field):
    resp = client.post("/v1/jobs", json=_verifier("regex", **args))
    assert _loc(resp) == ["body", "task_spec", "verifiers", 0, "args", field]


def test_other_verifier_args_are_checked(client):
    assert _loc(client.post("/v1/jobs", json=_verifier("code", cpu_s=0)))[-1] == "cpu_s"
    assert _loc(client.post("/v1/jobs", json=_verifier("openai_judge", url="http://judge:8000/v1")))[-1] == "model"
    assert _loc(client.post("/v1/jobs", json=_verifier("overlong", cache=-1)))[-1] == "cache"
    assert client.post("/v1/jobs", json=_verifier("regex", pattern=r"^\d+$", flags="im")).status_code == 201


@pytest.mark.parametrize(
    ("arg", "value", "cap"),
    [("parallel", 100_000, "16"), ("cpu_s", 11, "10"), ("wall_s", 30.5, "30.0"), ("memory_mb", 4096, "1024")],
)
def test_code_limits_above_their_caps_are_refused(client, arg, value, cap):
    # parallel went straight to the thread pool (the api accepted 100,000); the others were cut silently.
    resp = client.post("/v1/jobs", json=_verifier("code", **{arg: value}))
    assert _loc(resp)[-1] == arg
    assert f"at most {cap}" in resp.json()["detail"][0]["msg"], resp.json()
    assert client.post("/v1/jobs", json=_verifier("code", parallel=16, cpu_s=10, wall_s=30)).status_code == 201


def _source(path: Path, **extra) -> dict:
    return {
        "base_model": "m",
        "task": "mine",
        "task_spec": {"source": {"kind": "jsonl", "path": str(path), **extra}, "verifiers": [{"name": "exact"}]},
    }


def test_sources_are_read_at_submission(client, tmp_path):
    rows = tmp_path / "ok.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(50)))
    assert client.post("/v1/jobs", json=_source(rows)).status_code == 201
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,answer\nq,1\n")
    resp = client.post("/v1/jobs", json=_source(csv))
    assert _loc(resp) == ["body", "task_spec", "source", "path"] and "JSONL" in resp.json()["detail"][0]["msg"]
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert _loc(client.post("/v1/jobs", json=_source(binary))) == ["body", "task_spec", "source", "path"]
    assert _loc(client.post("/v1/jobs", json=_source(tmp_path / "missing.jsonl")))[-1] == "path"
    assert _loc(client.post("/v1/jobs", json=_source(tmp_path)))[-1] == "path"  # a folder
    assert _loc(client.post("/v1/jobs", json=_source(rows, prompt_field="question")))[-1] == "prompt_field"
    assert _loc(client.post("/v1/jobs", json=_source(rows, fields=["solution"])))[-1] == "fields"
    assert _loc(client.post("/v1/jobs", json=_source(rows, id_field="uid")))[-1] == "id_field"
    bad_template = _source(rows)
    bad_template["task_spec"]["template"] = "Q: {question}"
    assert _loc(client.post("/v1/jobs", json=bad_template)) == ["body", "task_spec", "template"]


# -- the rollout's context (item 17) ---------------------------------------------------------
def _beat(r, replica: str, model: str, max_model_len: int) -> None:
    fake_heartbeat(r, replica, rollout_model=model, max_model_len=max_model_len)


def test_max_tokens_beyond_every_rollout_context_is_refused(client, r):
    _beat(r, "r0", "m", 256)
    resp = client.post("/v1/jobs", json={"base_model": "m", "sampling": {"max_tokens": 300}})
    assert _loc(resp) == ["body", "sampling", "max_tokens"]
    assert "256" in resp.json()["detail"][0]["msg"]
    assert client.post("/v1/jobs", json={"base_model": "m", "sampling": {"max_tokens": 256}}).status_code == 422
    _beat(r, "r1", "m", 4096)  # one replica that fits is enough
    job = client.post("/v1/jobs", json={"base_model": "m", "sampling": {"max_tokens": 300}}).json()
    assert client.get(f"/v1/jobs/{job['id']}").json()["warnings"] == []


def test_unchecked_context_and_truncation_show_as_warnings(client, r):
    job = client.post("/v1/jobs", json={"base_model": "other-model", "sampling": {"max_tokens": 300}}).json()["id"]
    (warning,) = client.get(f"/v1/jobs/{job}").json()["warnings"]
    assert "no rollout replica serving other-model" in warning and "max_tokens=300" in warning
    _beat(r, "r0", "other-model", 4096)
    assert client.get(f"/v1/jobs/{job}").json()["warnings"] == []
    for _ in range(3):  # what rollout records when completions hit the length limit
        record_point(r, job, "rollout", {"groups": 8, "truncated_frac": 1.0})
    (warning,) = client.get(f"/v1/jobs/{job}").json()["warnings"]
    assert "truncated_frac" in warning and "100%" in warning
    for _ in range(20):
        record_point(r, job, "rollout", {"groups": 8, "truncated_frac": 0.0})
    assert client.get(f"/v1/jobs/{job}").json()["warnings"] == []


# -- `burstrl submit --follow` (item 18) ------------------------------------------------------
@pytest.fixture
def served(client):
    """The same app on a real uvicorn server on a free port (the api's own HTTP stack)."""
    with serve(client.app) as url:
        yield url


def test_follow_returns_when_a_job_without_evaluations_completes(client, r, served):
    from rich.console import Console

    from services.cli.follow import follow_job
    from shared.job import JobState, set_state

    job = client.post("/v1/jobs", json={"base_model": "m", "steps": 2, "eval_size": 0}).json()["id"]
    r.set(keys.policy_pointer(job), 2)
    set_state(r, job, JobState.completed, only_from={JobState.running})
    status = follow_job(served, job, {"Authorization": f"Bearer {TOKEN}"}, Console(quiet=True), timeout=30)
    assert status["outcome"] == "completed (no evaluation: eval_size = 0)"


def test_rollout_advertises_its_context():
    """In-process: the setting; remote: what the server's /v1/models card says (vLLM lists max_model_len)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from services.rollout.engine import engine_context
    from services.rollout.engine_remote import RemoteEngine
    from services.rollout.settings import RolloutSettings

    assert engine_context(RolloutSettings(model="m", dev=True, max_model_len=512), None) == 512

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            cards = [
                {"id": "base", "max_model_len": 2048},
                {"id": "other", "max_model_len": 64},
                {"id": "lora", "parent": "base", "max_model_len": 2048},
            ]
            body = json.dumps({"data": cards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        s = RolloutSettings(model="m", dev=True, engine="remote", engine_url=url, engine_served_model="base")
        engine = RemoteEngine(url=url, served_model="base")
        assert engine_context(s, engine) == 2048
        engine.close()
    finally:
        srv.shutdown()


def test_a_backlog_budget_the_store_cannot_hold_is_a_422(client):
    """Issue 19: a budget the deployment cannot hold is a clear 422, never a silent drop."""
    body = {"name": "big", "base_model": "m", "eval_size": 0, "backlog": {"max_groups": 1000, "max_bytes": 1 << 44}}
    resp = client.post("/v1/jobs", json=body)
    assert _loc(resp) == ["body", "backlog", "max_bytes"]
    assert "bytes free under the object store" in resp.json()["detail"][0]["msg"]
    body["backlog"]["max_bytes"] = 1 << 20
    assert client.post("/v1/jobs", json=body).status_code == 201
