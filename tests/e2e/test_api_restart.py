"""The api holds no state of its own: kill -9 it, start it again, and every job is back
with its state, and the feeder carries on from the durable position (no prompt fed twice,
none skipped). Also `burstrl logs` on the processes the launcher started.

Real processes: redis-server (conftest) and the api, started the way `burstrl up` does.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.cli.launch import alive, free_port
from shared import keys
from shared.bus import FIELD
from shared.domain.tasks import task_for_job
from shared.job import JobSpec
from shared.schema import PromptMsg, decode
from tests.support.cli import burstrl
from tests.support.launched import service_launcher

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "restart-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _prompts(r, job_id: str) -> list[PromptMsg]:
    return [decode(f[FIELD], PromptMsg) for _, f in r.xrange(keys.prompts(job_id))]


@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def api(r, redis_server, home):
    """Start/kill/restart the api as a real process under <home>/run, as `burstrl up` does."""
    port = free_port()
    with service_launcher(home, redis_server.url, TOKEN, BURSTRL_API_FEED_INTERVAL_S="0.1") as (launcher, env):

        def start() -> int:
            p = launcher.start_service("api", env, port=port)
            launcher.wait_ready(["api"], timeout=60)
            return p.pid

        yield launcher, start, f"http://127.0.0.1:{port}"


def test_job_survives_api_kill_9_and_feeding_resumes(api, r):
    launcher, start, base = api
    pid = start()
    spec = {"name": "survivor", "base_model": "m", "batch_size": 4, "max_staleness": 1, "seed": 7}
    running = httpx.post(f"{base}/v1/jobs", json=spec, headers=AUTH).json()["id"]
    paused = httpx.post(f"{base}/v1/jobs", json={**spec, "name": "sleeper"}, headers=AUTH).json()["id"]
    assert httpx.post(f"{base}/v1/jobs/{paused}/pause", headers=AUTH).json()["state"] == "paused"
    _until(lambda: r.xlen(keys.prompts(running)) == 8, "the feeder to fill the window")
    # The feeder may have filled the second job's window before the pause landed; give it
    # room then, so that "not fed while paused" means something.
    held = r.xlen(keys.prompts(paused))
    if held:
        r.hincrby(keys.ledger(paused), "trained", 4)

    os.killpg(pid, signal.SIGKILL)  # no shutdown hook runs: as a power cut or OOM kill would
    _until(lambda: not alive(pid), "the api to die")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/v1/jobs", headers=AUTH, timeout=2)
    # While the api is down the trainer consumes a batch; nobody feeds.
    r.hincrby(keys.ledger(running), "trained", 4)
    time.sleep(0.5)
    assert r.xlen(keys.prompts(running)) == 8

    start()
    jobs = {j["id"]: j for j in httpx.get(f"{base}/v1/jobs", headers=AUTH).json()}
    assert jobs[running]["state"] == "running" and jobs[paused]["state"] == "paused"
    assert jobs[running]["spec"]["seed"] == 7
    status = httpx.get(f"{base}/v1/jobs/{running}", headers=AUTH).json()
    assert status["ledger"]["fed"] >= 8 and status["ledger"]["trained"] == 4

    # The feeder resumes at the durable position: g8.. continue the same prompt order.
    _until(lambda: r.xlen(keys.prompts(running)) == 12, "the feeder to resume")
    got = _prompts(r, running)
    assert [m.group_id for m in got] == [f"{running}:g{i}" for i in range(12)]
    expected = itertools.islice(task_for_job(JobSpec(**spec)).train_items(7), 12)
    assert [m.item_id for m in got] == [it.item_id for it in expected]
    assert r.xlen(keys.prompts(paused)) == held  # paused stays paused across the restart

    assert httpx.post(f"{base}/v1/jobs/{paused}/resume", headers=AUTH).json()["state"] == "running"
    _until(lambda: r.xlen(keys.prompts(paused)) == (12 if held else 8), "the resumed job to be fed")
    time.sleep(0.5)
    assert r.xlen(keys.prompts(running)) == 12  # window full again: nothing more

    # `burstrl logs api` shows both lives of the api (the log is appended to, not replaced).
    res = _burstrl(launcher.run_dir.parent, "logs", "api", "-n", "200")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("api listening on") == 2


def _burstrl(home: Path, *args: str) -> subprocess.CompletedProcess:
    return burstrl(*args, timeout=60, BURSTRL_HOME=str(home))


def test_logs_follow_and_unknown_service(home):
    logs = home / "run" / "logs"
    logs.mkdir(parents=True)
    log = logs / "reward.log"
    log.write_text("".join(f"line {i} [not markup]\n" for i in range(100)))

    res = _burstrl(home, "logs", "reward", "-n", "3")
    assert res.stdout.splitlines() == ["line 97 [not markup]", "line 98 [not markup]", "line 99 [not markup]"]
    missing = _burstrl(home, "logs", "trainer")
    assert missing.returncode == 1 and "reward" in missing.stderr

    env = {**os.environ, "BURSTRL_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "logs", "reward", "--follow", "-n", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        seen = ""

        def read_until(text: str) -> None:
            nonlocal seen
            deadline = time.time() + 30
            while text not in seen:
                assert time.time() < deadline, f"no {text!r} in {seen!r}"
                ready, _, _ = select.select([proc.stdout], [], [], 0.5)
                if ready:
                    seen += os.read(proc.stdout.fileno(), 4096).decode()

        read_until("line 99")
        with open(log, "a") as f:
            f.write("appended while following\n")
        read_until("appended while following")
        log.write_text("after truncation\n")  # rotated/truncated: follow from its start
        read_until("after truncation")
        assert "line 98" not in seen
    finally:
        proc.terminate()
        proc.wait(timeout=10)
