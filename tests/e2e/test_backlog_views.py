"""The backlog where people look: the dashboard's JSON and page, /metrics, `burstrl status JOB`
(against the api and reward services as real processes, headless Chromium for the page)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from shared.store import FileStore
from tests.support.backlog import group, push_ready, runtime, spiller
from tests.support.cli import burstrl
from tests.support.dashboard import TOKEN, dashboard_page, require_browser
from tests.support.heartbeats import fake_heartbeat

ROOT = Path(__file__).resolve().parents[2]
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def _backlog_job(base: str, r, redis_url: str, store: FileStore) -> str:  # noqa: ANN001
    spec = {
        "name": "blv",
        "base_model": "m",
        "batch_size": 4,
        "group_size": 4,
        "backlog": {"max_groups": 48, "segment_groups": 8, "order": "freshest"},
    }
    resp = httpx.post(f"{base}/v1/jobs", json=spec, headers=HEADERS, timeout=10)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    # Paused: the api's feeder leaves it alone (the spiller does not); stand in for rollout with
    # ready groups an hour old.
    assert httpx.post(f"{base}/v1/jobs/{job_id}/pause", headers=HEADERS, timeout=10).status_code == 200
    push_ready(r, job_id, [group(job_id, i, sampled_at=time.time() - 3600) for i in range(40)])
    rt = runtime(redis_url, replica="view-0")
    spiller(rt, store, replica="view-0").tick()
    fake_heartbeat(r, "view-0", idle_frac=0.031)
    return job_id


def test_dashboard_json_status_and_page_show_the_backlog(stack, r, redis_server, tmp_path):  # noqa: F811
    base, _ = stack
    store = FileStore(tmp_path / "store")
    job_id = _backlog_job(base, r, redis_server.url, store)
    windowed = httpx.post(f"{base}/v1/jobs", json={"name": "win", "base_model": "m"}, headers=HEADERS).json()["id"]
    ov = httpx.get(f"{base}/v1/dashboard", headers=HEADERS, timeout=10).json()
    jobs = {j["id"]: j for j in ov["jobs"]}
    b = jobs[job_id]["backlog"]
    assert b["groups"] == 32 and b["segments"] == 4 and b["bytes"] > 0 and b["order"] == "freshest"
    assert b["oldest_versions"] == 0 and 0.9 < b["oldest_hours"] < 1.2
    assert jobs[windowed]["backlog"] is None
    assert next(s for s in ov["services"] if s["replica"] == "view-0")["idle_frac"] == 0.031

    # `burstrl status JOB`: the backlog and rollout's idle fraction in the summary.
    out = burstrl("status", job_id, "--api", base, BURSTRL_TOKEN=TOKEN)
    assert out.returncode == 0, out.stderr
    assert "backlog: 32 groups" in out.stdout and "4 segments" in out.stdout, out.stdout
    assert "oldest 0 versions" in out.stdout and "freshest first" in out.stdout
    assert "rollout view-0: idle 3.1%" in out.stdout

    require_browser()
    from playwright.sync_api import expect

    with dashboard_page(base, width=1600) as page:
        row = page.locator(f'#jobs tr[data-job="{job_id}"] td[data-backlog]')
        expect(row).to_contain_text("32 groups", timeout=15_000)
        expect(row).to_contain_text("oldest 0 versions")
        expect(page.locator(f'#jobs tr[data-job="{windowed}"] td[data-backlog]')).to_contain_text("windowed")
        expect(page.locator('#services tr[data-role="rollout"] td[data-idle]')).to_contain_text("3.1%")
        page.select_option("#job-select", job_id)
        page.wait_for_function("() => window.burstrl.seriesLength('backlog') >= 1", timeout=15_000)


def test_rollout_metrics_carry_the_backlog_gauges(r, redis_server, tmp_path):
    from tests.support.backlog import new_job, spec

    store = FileStore(tmp_path / "store")
    rec = new_job(r, spec(max_groups=16, segment_groups=8))
    push_ready(r, rec.id, [group(rec.id, i) for i in range(24)])
    rt = runtime(redis_server.url)
    spiller(rt, store).tick()
    from fastapi.testclient import TestClient

    with TestClient(rt.app) as c:
        text = c.get("/metrics").text
    assert f'burstrl_backlog_groups{{job="{rec.id}"}} 16.0' in text
    assert f'burstrl_backlog_full{{job="{rec.id}"}} 1.0' in text  # 8 hot + 16 on disk: the budget is full
    assert "burstrl_backlog_spill_failures_total 0.0" in text
