"""What the trainer and the api say, and what they leave in Redis, when the store goes away or Redis
loses its data mid-job (docs/architecture.md, invariant 11). Real processes: the api and the trainer
as services over HTTP, a real redis-server, the store on file:// or on a real S3-protocol server
(moto) behind a proxy the test cuts; rollout and reward are the in-process stand-in of
tests/support/window.py (no engine: these faults are between the trainer, the api and the stores).

Before:
- through a whole store outage the trainer's /readyz said 200, store ok, "training <job>", while
  it held no lease and failed every second;
- after a FLUSHALL the trainer logged "another trainer holds it now" (false: the lease had
  vanished with the data), wrote a session point into the emptied Redis (keys that then survived
  recovery), and the api's `orphans` check stayed ok while the job was an orphan.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.api.jobs import create_job
from services.cli.launch import free_port
from shared import keys
from shared.job import JobSpec, JobState, load_job
from shared.ledger import audit
from shared.metrics import read_ledger
from shared.store import FileStore
from tests.support.jobs import fresh_tiny_model, small_spec
from tests.support.launched import service_launcher
from tests.support.proxy import TcpProxy
from tests.support.servers import make_bucket
from tests.support.stack import readyz, wait_for
from tests.support.window import FeedLoop, Sampler, completed, sample_until, stop_all

TOKEN = "outage-test-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
BATCH, G = 2, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_tiny_model(tmp_path_factory)


def _spec(model_dir: Path, steps: int) -> JobSpec:
    return small_spec(model_dir, name="outage", group=G, batch=BATCH, steps=steps, eval_size=0)


def _check(port: int, name: str) -> dict:
    return readyz(port)[1].get("checks", {}).get(name, {})


@pytest.mark.slow
def test_trainer_readiness_reports_a_store_outage_and_the_lease_it_lost(
    r, tmp_path, model_dir, redis_server, s3_endpoint
):
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    proxy.up()
    make_bucket(s3_endpoint, "outage")
    rec = create_job(r, spec=_spec(model_dir, steps=40))
    threads = FeedLoop(r, FileStore(tmp_path / "unused")), Sampler(r, rec.id, g=G)
    port = free_port()
    with service_launcher(tmp_path, redis_server.url, TOKEN) as (launcher, env):
        env = {
            **env,
            "STORE_URL": "s3://outage/run",
            "STORE_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
            "BURSTRL_TRAINER_DEVICE": "cpu",
        }
        launcher.start_service("trainer", env, port=port)
        for th in threads:
            th.start()
        try:
            wait_for(lambda: read_ledger(r, rec.id).get("trained", 0) >= 2 * BATCH, 240, "two steps", launcher)
            assert readyz(port)[0] == 200
            proxy.down()

            def loud() -> bool:
                code, body = readyz(port)
                checks = body.get("checks", {})
                store, job = checks.get("store", {}), checks.get("job", {})
                return (
                    code == 503
                    and store.get("ok") is False
                    and "unreachable" in store.get("reason", "")
                    and job.get("ok") is False
                    and "holds no lease" in job.get("reason", "")
                    and r.get(keys.trainer_lease(rec.id)) is None
                )

            wait_for(loud, 120, "/readyz to report the store outage and the lease it no longer holds", launcher)
            proxy.up()
            wait_for(lambda: readyz(port)[0] == 200, 120, "ready again once the store is back", launcher)
            wait_for(lambda: load_job(r, rec.id).state == JobState.completed, 300, "the job to complete", launcher)
        finally:
            stop_all(*threads)
            proxy.down()
    a = audit(r, rec.id)
    assert a.balanced, a.problems
    assert a.counters["trained"] == 40 * BATCH and a.counters.get("dead", 0) == 0, a.counters


@pytest.mark.slow
def test_a_flushall_mid_job_is_loud_writes_nothing_and_recovers_clean(r, tmp_path, model_dir, redis_server):
    api_port, trainer_port = free_port(), free_port()
    with service_launcher(tmp_path, redis_server.url, TOKEN, BURSTRL_TRAINER_DEVICE="cpu") as (launcher, env):
        launcher.start_service("api", env, port=api_port)
        launcher.start_service("trainer", env, port=trainer_port)
        launcher.wait_ready(["api", "trainer"], timeout=180)
        api = f"http://127.0.0.1:{api_port}"
        body = _spec(model_dir, steps=12).model_dump(mode="json")
        job_id = httpx.post(f"{api}/v1/jobs", json=body, headers=HEADERS, timeout=30).json()["id"]

        def two_steps() -> bool:
            return read_ledger(r, job_id).get("trained", 0) >= 2 * BATCH

        # Exactly two steps' groups: the trainer then waits mid-job, holding its lease, when
        # Redis is flushed (an unbounded sampler let it finish all 12 steps first, in CI).
        sample_until(r, job_id, G, two_steps, 240, "two steps", launcher, limit=2 * BATCH)
        r.flushall()  # Redis loses everything mid-job; the store keeps the job and its checkpoints

        log = Path(launcher.procs()["trainer"].log)
        wait_for(lambda: "its lease is gone from Redis" in log.read_text(), 120, "the trainer to say why", launcher)
        wait_for(
            lambda: _check(trainer_port, "job").get("ok") is False and _check(trainer_port, "redis").get("ok") is False,
            60,
            "the trainer not ready, holding no lease",
            launcher,
        )
        orphans = wait_for(
            lambda: (lambda c: c if c.get("ok") is False else None)(_check(api_port, "orphans")),
            120,
            "the api's orphans check to name the job",
            launcher,
        )
        assert job_id in orphans["reason"], orphans
        assert "another trainer holds it now" not in log.read_text()
        # Nothing of the job was written into the emptied Redis (it wrote a session point before).
        assert list(r.scan_iter(match=keys.job_key_pattern(job_id))) == []
        r.xadd(keys.metrics(job_id), {b"m": b"a late writer's point"})  # as a step finishing late would

        got = httpx.post(f"{api}/v1/orphans/recover", headers=HEADERS, timeout=60).json()
        assert got["recovered"] == [job_id]
        assert all(f[b"m"] != b"a late writer's point" for _, f in r.xrange(keys.metrics(job_id)))
        sample_until(r, job_id, G, completed(r, job_id), 300, "the recovered job to complete", launcher)
        wait_for(lambda: _check(api_port, "orphans").get("ok") is True, 120, "the orphans check to clear", launcher)
        assert readyz(api_port)[0] == 200
    a = audit(r, job_id)
    assert a.balanced, a.problems
    assert a.counters["trained"] == 12 * BATCH, a.counters
