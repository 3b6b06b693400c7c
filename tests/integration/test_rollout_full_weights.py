"""Full-weight versions in the rollout worker, with a fake engine (fast, tests/support/fake_engine.py):
a full-weight job needs a pool of its own, a refused full-weight version leaves the previous
weights serving, and an engine that cannot load full weights refuses them before downloading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shared import keys
from shared.bus import FIELD
from shared.job import load_job
from shared.schema import GroupMsg, decode
from tests.support.fake_engine import BASE_LP, CountingStore, FakeEngine, fake_full, feed, good, worker_factory
from tests.support.rollout import add_job, corrupt, publish


@pytest.fixture
def env(tmp_path: Path, redis_server, r):  # noqa: ANN001, ANN201
    store = CountingStore(tmp_path / "store")
    return worker_factory(tmp_path, redis_server.url, store), store, r


@pytest.fixture
def base_dir(tmp_path: Path) -> str:
    """A 'base model' folder: config and tokenizer files (and weights, which must not be copied)."""
    d = tmp_path / "base-model"
    d.mkdir()
    (d / "config.json").write_text('{"v": "base"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_text('{"lp": [-9.0, -9.0, -9.0]}')
    return str(d)


def _refused_metric(http: TestClient, job_id: str) -> str:
    (line,) = [
        x
        for x in http.get("/metrics").text.splitlines()
        if x.startswith(f'burstrl_rollout_job_refused{{job="{job_id}"}}')
    ]
    return line.rsplit(" ", 1)[1]


def test_full_weight_job_needs_a_pool_of_its_own(env, base_dir: str) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make(model=base_dir)
    lora = add_job(r, base_dir, name="lora", eval_size=0, group_size=2)
    full = add_job(r, base_dir, name="full", eval_size=0, group_size=2)
    publish(store, r, lora.id, 1, *good(1))
    publish(store, r, full.id, 1, *fake_full([-2.0, -2.0, -2.0]))
    w.refresh_jobs()
    # The full-weight version would replace the base model under the LoRA job: not adopted.
    assert w.jobs[full.id].version == 0 and w.jobs[lora.id].version == 1 and eng.full_loads == []
    reason = http.get("/readyz").json()["checks"][f"policy:{full.id}"]["reason"]
    assert "full weights" in reason and lora.id in reason and "pool of their own" in reason
    assert "pool of their own" in load_job(r, full.id).error
    assert _refused_metric(http, full.id) == "1.0"
    assert 1 not in w.jobs[full.id].refused  # waiting, not refused
    # ...and the LoRA job keeps being served on its adapter.
    feed(r, lora.id, 1)
    w.tick()
    (_, f), *_ = r.xrange(keys.rollouts(lora.id))
    assert decode(f[FIELD], GroupMsg).policy_version == 1
    # The LoRA job ends: the pool is the full job's alone now, v1 is adopted.
    r.srem(keys.active_jobs(), lora.id)
    w.refresh_jobs()
    view = w.jobs[full.id]
    assert view.version == 1 and view.current.full and w.full_owner == full.id
    (path,) = eng.full_loads
    assert path is not None and Path(path).name == "model" and (Path(path) / "tokenizer.json").exists()
    assert json.loads((Path(path) / "config.json").read_text()) == {"v": "base"}  # the base's config
    assert load_job(r, full.id).error == "" and _refused_metric(http, full.id) == "0.0"
    assert http.get("/readyz").status_code == 200
    # Another job arrives while the engine holds the full job's weights: refused, not served.
    other = add_job(r, base_dir, name="other", eval_size=0, group_size=2)
    feed(r, other.id, 1)
    w.tick()
    assert other.id not in w.jobs and r.xlen(keys.rollouts(other.id)) == 0
    reason = http.get("/readyz").json()["checks"][f"policy:{other.id}"]["reason"]
    assert f"full weights of job {full.id}" in reason and "full weights" in load_job(r, other.id).error
    assert _refused_metric(http, other.id) == "1.0"
    # v2 (full) replaces v1; the previous version's folder goes.
    v1_folder = view.current.folder
    publish(store, r, full.id, 2, *fake_full([-3.0, -3.0, -3.0]))
    w.refresh_jobs()
    assert view.version == 2 and len(eng.full_loads) == 2 and v1_folder and not v1_folder.exists()
    # The full job ends: the engine serves the base model again, the other job is served.
    r.srem(keys.active_jobs(), full.id)
    w.tick()
    assert eng.full_loads[-1] is None and w.full_owner is None and eng.base_lp == BASE_LP
    assert other.id in w.jobs and load_job(r, other.id).error == "" and _refused_metric(http, other.id) == "0.0"
    w.tick()
    assert r.xlen(keys.rollouts(other.id)) == 1


def test_full_weight_refusals_keep_the_previous_weights(env, base_dir: str) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make(model=base_dir)
    job = add_job(r, base_dir, eval_size=0, group_size=2)
    publish(store, r, job.id, 1, *fake_full([-2.0, -2.0, -2.0]))
    w.refresh_jobs()
    assert w.jobs[job.id].version == 1 and eng.base_lp == [-2.0] * 3
    v1_model = eng.full_loads[-1]
    # v2: a corrupted weights file -> refused by its sha256, before the engine is touched.
    publish(store, r, job.id, 2, *fake_full([-3.0, -3.0, -3.0]))
    corrupt(store, job.id, 2, "model.safetensors")
    # v3: the probe belongs to other weights -> loaded, probed, and switched back to v1.
    publish(store, r, job.id, 3, *fake_full([-4.0, -4.0, -4.0], probe_lp=[-1.0, -1.0, -1.0]))
    for _ in range(2):
        w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 1 and sorted(view.refused) == [2, 3]
    # Newest first: v3 was switched to and back (two loads), v2 never reached the engine.
    assert len(eng.full_loads) == 3 and eng.full_loads[-1] == v1_model and eng.base_lp == [-2.0] * 3
    assert "ProbeMismatch" in view.refused[3].reason and "VerificationError" in view.refused[2].reason
    reason = http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    assert "v2 refused (hash)" in reason and "still serving v1" in reason
    text = http.get("/metrics").text
    assert f'burstrl_rollout_verify_failures_total{{job="{job.id}",kind="hash"}} 1.0' in text
    assert view.current.folder and (view.current.folder / "model").is_dir()


def test_engine_without_full_weights_refuses_them(env, base_dir: str) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make(model=base_dir, engine=FakeEngine(full_weights=False))
    job = add_job(r, base_dir, eval_size=0, group_size=2)
    publish(store, r, job.id, 1, *fake_full([-2.0, -2.0, -2.0]))
    w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 0 and 1 in view.refused and eng.full_loads == []
    reason = http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    assert "v1 refused (unsupported)" in reason and "in-process rollout pool" in reason
    assert "refused (unsupported)" in load_job(r, job.id).error
    assert not (w.cache / job.id / "policy-v1").exists()  # refused before downloading the weights
    feed(r, job.id, 1)
    w.tick()  # and the service keeps serving the job's last good version (the base)
    (_, f), *_ = r.xrange(keys.rollouts(job.id))
    assert decode(f[FIELD], GroupMsg).policy_version == 0
