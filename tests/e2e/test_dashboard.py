"""The dashboard in headless Chromium against a real stack: redis-server, the api and the
reward service as separate processes, a job seeded over HTTP with metric points.

Needs Debian's `chromium` (apt-get install chromium) and Playwright from PyPI; Playwright's
own browser downloads are not used (machines are offline).
"""

from __future__ import annotations

import time

import httpx
import pytest

from shared import keys
from shared.lease import Lease
from shared.metrics import record_eval, record_point, record_session_point
from shared.policy import advance_pointer
from shared.schema import encode_point
from tests.support.dashboard import TOKEN, dashboard_page, login, require_browser
from tests.support.heartbeats import fake_heartbeat


def _seed_job(base: str, r) -> str:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    resp = httpx.post(f"{base}/v1/jobs", json={"name": "dash", "base_model": "m", "steps": 10}, headers=headers)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    for step in range(1, 6):
        record_point(
            r,
            job_id,
            "trainer",
            {
                "step": step,
                "reward_mean": 0.1 * step,
                "reward_parts": {"correct": 0.08 * step, "format": 0.02 * step},
                "loss": 1.0 / step,
                "kl_ref": 0.01 * step,
                "mismatch_kl": 0.001,
                "grad_norm": 0.5,
            },
        )
        record_point(r, job_id, "rollout", {"groups": 8, "seconds": 2.0})
    for v in range(3):
        record_eval(r, job_id, v, {"accuracy": 0.2 + 0.1 * v, "greedy_accuracy": 0.3 + 0.1 * v, "mean_reward": 0.2})
    # A rollout replica one version behind the pointer, as its heartbeat would say.
    lease = Lease(r, job_id, "test-trainer", 60)
    assert lease.acquire()
    advance_pointer(r, job_id, 3, lease.fence)
    lease.release()
    fake_heartbeat(r, "fake-0", policy_versions={job_id: 2})
    return job_id


def test_dashboard_shows_services_queues_and_curves(stack, r, tmp_path):
    require_browser()
    from playwright.sync_api import expect

    base, _ = stack
    job_id = _seed_job(base, r)
    # The page and its assets need no token; the data behind them does.
    assert httpx.get(f"{base}/dashboard").status_code == 200
    assert httpx.get(f"{base}/dashboard/static/vendor/uPlot.iife.min.js").status_code == 200
    assert httpx.get(f"{base}/v1/dashboard").status_code == 401

    with dashboard_page(base, log_in=False) as page:
        expect(page.locator("#status")).to_contain_text("token", timeout=10_000)  # 401 until logged in
        assert page.locator("#services tbody tr[data-role]").count() == 0

        login(page)
        services = page.locator("#services tbody")
        expect(services).to_contain_text("api", timeout=15_000)
        expect(services).to_contain_text("reward")
        expect(page.locator(f'#jobs tr[data-job="{job_id}"]')).to_contain_text("prompts")
        expect(page.locator(f'#jobs tr[data-job="{job_id}"]')).to_contain_text("fake-0: v2 (1 behind)")

        page.wait_for_function("() => window.burstrl.seriesLength('reward') === 5", timeout=15_000)
        assert page.evaluate("window.burstrl.seriesLength('eval')") == 3
        assert page.evaluate("window.burstrl.seriesLength('kl')") == 5
        labels = page.evaluate("window.burstrl.charts.reward.plot.series.map(s => s.label)")
        assert {"reward_mean", "reward_parts/correct", "reward_parts/format"} <= set(labels)
        assert page.evaluate("window.burstrl.charts.reward.plot.data[1][4]") == pytest.approx(0.5)

        # New points arrive through the `after` cursor, not a full reload.
        record_point(r, job_id, "trainer", {"step": 6, "reward_mean": 0.6, "loss": 0.1, "kl_ref": 0.05})
        page.wait_for_function("() => window.burstrl.seriesLength('reward') === 6", timeout=15_000)

        # The token stays in this tab's sessionStorage, never in the URL.
        assert page.evaluate("sessionStorage.getItem('burstrl.token')") == TOKEN
        assert TOKEN not in page.url
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)


def test_dashboard_json_lists_queues_and_adoption(stack, r):
    base, _ = stack
    job_id = _seed_job(base, r)
    ov = httpx.get(f"{base}/v1/dashboard", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    roles = {s["role"] for s in ov["services"]}
    assert {"api", "reward", "rollout"} <= roles
    job = next(j for j in ov["jobs"] if j["id"] == job_id)
    assert set(job["queues"]) == {"prompts", "rollouts", "scored", "ready", "dead"}
    assert job["policy_version"] == 3
    assert job["adoption"] == [{"role": "rollout", "replica": "fake-0", "version": 2, "behind": 1}]
    assert job["last_eval"]["version"] == 2
    # The real api's feeder fills the job's window: (max_staleness + 1) x batch_size prompts.
    deadline = time.time() + 15
    while job["queues"]["prompts"]["length"] < 16 and time.time() < deadline:
        time.sleep(0.2)
        ov = httpx.get(f"{base}/v1/dashboard", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
        job = next(j for j in ov["jobs"] if j["id"] == job_id)
    assert job["queues"]["prompts"] == {"length": 16, "pending": 0, "lag": 16}
    assert job["ledger"]["in_flight"] == 16


def _at(r, job_id: str, at: float, source: str, values: dict) -> None:
    """A metric point as if recorded at `at` (record_point stamps now): bursts hours apart."""
    r.xadd(keys.metrics(job_id), {b"m": encode_point(source, at, values)})


def _seed_sessions(r, job_id: str) -> list[int]:
    """Two bursts that ended and one in progress, as the trainer records them (step_report.Session),
    one after the other: each starts up for 60 s, trains, and the next comes 20 minutes later."""
    from services.trainer.step_report import Session

    t0 = time.time() - 3 * 1800
    epochs = []
    for i, (lags, end) in enumerate([([0, 1], True), ([7, 7, 9], True), ([1], False)]):
        lease = Lease(r, job_id, f"h200-{i}", 60)
        assert lease.acquire()
        epochs.append(lease.epoch)
        start = t0 + 1800 * i
        s = Session(process_start=start, epoch=lease.epoch, replica=f"h200-{i}", step=i * 3)
        s.claimed_at = start + 60
        _at(r, job_id, start + 60, "trainer_session", {**s.point("start"), "billable_s": 60.0})
        for k, lag in enumerate(lags):
            point = {"step": i * 3 + k + 1, "groups": 4, "staleness_mean": float(lag), "staleness_hist": {str(lag): 4}}
            _at(r, job_id, start + 60 + 100 * (k + 1), "trainer", point)
            s.trained(point)
        if end:
            billable = 60 + 100 * len(lags) + 30
            ended = {**s.point("end", reason="time budget: 60 s left"), "billable_s": float(billable)}
            _at(r, job_id, start + billable, "trainer_session", ended)
            lease.release()
    return epochs


def test_dashboard_draws_the_burst_timeline(stack, r, tmp_path):
    require_browser()
    from playwright.sync_api import expect

    base, _ = stack
    job_id = _seed_job(base, r)
    epochs = _seed_sessions(r, job_id)
    with dashboard_page(base) as page:
        rows = page.locator("#bursts tbody tr[data-epoch]")
        expect(rows).to_have_count(3, timeout=15_000)
        first, second, now = (page.locator(f'#bursts tr[data-epoch="{e}"]') for e in epochs)
        expect(first).to_have_attribute("data-status", "ended")
        expect(first.locator("[data-steps]")).to_have_text("2")
        expect(first.locator("[data-lag]")).to_have_text("0.50 / 1")
        expect(second.locator("[data-lag]")).to_have_text("7.67 / 9")  # data many versions old
        expect(second).to_contain_text("time budget")
        expect(first.locator("[data-billable]")).to_have_text("290.0")  # start-up, 2 steps, checkpoint
        expect(now).to_have_attribute("data-status", "training")
        expect(now.locator("[data-steps]")).to_have_text("1")
        # One bar per session on the time axis; the one in progress drawn as such.
        bars = page.locator("#burst-timeline .burst")
        expect(bars).to_have_count(3)
        expect(page.locator(f'#burst-timeline .burst.training[data-epoch="{epochs[2]}"]')).to_have_count(1)
        expect(page.locator("#burst-totals")).to_contain_text("3 sessions")
        expect(page.locator("#burst-totals")).to_contain_text("6 steps")
        lefts = [float(bars.nth(i).evaluate("b => parseFloat(b.style.left)")) for i in range(3)]
        assert lefts == sorted(lefts) and lefts[0] == 0

        # The session ends: its end point arrives through the metrics cursor and the row follows.
        from services.trainer.step_report import Session

        s = Session(process_start=time.time() - 1800 + 120, epoch=epochs[2], replica="h200-2", step=6)
        s.trained({"groups": 4, "staleness_mean": 1.0, "staleness_hist": {"1": 4}})
        record_session_point(r, job_id, s.point("end", reason="the job completed"))  # as the trainer does
        expect(now).to_have_attribute("data-status", "ended", timeout=15_000)
        expect(now).to_contain_text("the job completed")
        page.screenshot(path=str(tmp_path / "bursts.png"), full_page=True)
