"""Chaos on the bus: real redis-server and real stage processes, killed with SIGKILL.

Each test ends by auditing the ledger against the streams in one atomic snapshot
(shared/ledger.py): fed = trained + dropped + dead + in flight, with "in flight" equal
to what the streams physically hold.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from shared import keys
from shared.bus import FIELD, Bus
from shared.ledger import audit
from shared.metrics import read_ledger
from tests.support.servers import RedisServer
from tests.support.stack import wait_for

STAGE = Path(__file__).resolve().parents[1] / "support" / "chaos_stage.py"
_SEQ = itertools.count()


def _spawn(url: str, job: str, mode: str, *args: str) -> subprocess.Popen:
    # stderr kept per process (in the temp dir) so a failure can be read afterwards
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"burstrl-{job}-{mode}-{next(_SEQ)}.log"
    return subprocess.Popen(
        [sys.executable, str(STAGE), mode, "--redis", url, "--job", job, *args],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


_wait = functools.partial(wait_for, poll_s=0.1)  # (pred, timeout, what): the harness's load-stretched wait


def _pipeline(url: str, job: str, ckpt: Path, total: int, skip: str = "") -> list[subprocess.Popen]:
    """Feeder first (so procs[0] is it), three middle stages, and the trainer-like sink."""
    procs = [_spawn(url, job, "feed", "--total", str(total), "--window", "12")]
    try:
        for group in (keys.GROUP_ROLLOUT, keys.GROUP_REWARD, keys.GROUP_REF):
            if group != skip:
                procs.append(_spawn(url, job, "stage", "--group", group))
        procs.append(_spawn(url, job, "sink", "--ckpt", str(ckpt), "--batch", "4"))
    except BaseException:
        _kill(*procs)
        raise
    return procs


def _trained(ckpt: Path) -> list[str]:
    return ckpt.read_text().split() if ckpt.exists() else []


def test_consumer_killed_between_read_and_ack_is_redone_once(r, redis_server, tmp_path):
    job = "chaos-kill-consumer"
    Bus.ensure_groups(r, job)
    pipe = r.pipeline(transaction=True)
    for i in range(12):
        pipe.xadd(keys.prompts(job), {FIELD: f"{job}:g{i}".encode()})
    pipe.hincrby(keys.ledger(job), "fed", 12)
    pipe.execute()
    marker = tmp_path / "read.json"
    victim = _spawn(redis_server.url, job, "stage", "--consumer", "victim", "--hold-s", "60", "--marker", str(marker))
    try:
        _wait(marker.exists, 30, "the victim to read entries")
        held = json.loads(marker.read_text())
        assert held and r.xpending(keys.prompts(job), keys.GROUP_ROLLOUT)["pending"] == len(held)
        _kill(victim)  # SIGKILL between read and hand-on: its entries stay pending
        heir = _spawn(redis_server.url, job, "stage", "--consumer", "heir")
        try:
            _wait(lambda: r.xlen(keys.rollouts(job)) >= 12, 30, "the heir to hand on all 12")
            time.sleep(1.0)  # a duplicate, if the bus let one through, would show up now
        finally:
            _kill(heir)
    finally:
        _kill(victim)
    out = Counter(f[FIELD].decode() for _, f in r.xrange(keys.rollouts(job)))
    assert sorted(out) == sorted(f"{job}:g{i}" for i in range(12)) and set(out.values()) == {1}
    assert set(held) <= set(out)
    a = audit(r, job)
    assert a.balanced, a.problems
    assert a.counters["produced"] == 12 and a.in_streams["rollouts"] == 12


def test_redis_killed_under_load_restarts_from_aof_and_nothing_is_lost(tmp_path):
    srv = RedisServer(tmp_path / "redis")
    srv.dir.mkdir()
    srv.start()
    job, total = "chaos-redis", 60
    ckpt = tmp_path / "trained.txt"
    procs = _pipeline(srv.url, job, ckpt, total)
    try:
        _wait(lambda: len(_trained(ckpt)) >= 12, 90, "training to get going")
        srv.kill()  # SIGKILL under load; AOF everysec may lose the last second
        time.sleep(1.0)
        srv.start()
        r = srv.client()
        _wait(lambda: read_ledger(r, job).get("trained", 0) >= total, 180, f"all {total} groups to be trained")
        _wait(lambda: procs[0].poll() is not None, 30, "the feeder to finish (it trims on the way out)")
        trained = _trained(ckpt)
        assert Counter(trained).most_common(1)[0][1] == 1, "a group was trained twice"
        assert sorted(trained) == sorted(f"{job}:g{i}" for i in range(total))
        a = audit(r, job)
        assert a.balanced, a.problems
        assert a.counters["fed"] == total and a.counters["trained"] == total and a.in_flight == 0
        assert all(r.xlen(s) == 0 for s in keys.job_streams(job)), "acknowledged entries were not trimmed"
    finally:
        _kill(*procs)
        srv.kill()


def test_trimming_under_a_backlog_loses_nothing(redis_server, r, tmp_path):
    """The feeder trims on every tick while a slow stage holds a backlog, pending and not."""
    job, total = "chaos-trim", 40
    ckpt = tmp_path / "trained.txt"
    procs = [p for p in _pipeline(redis_server.url, job, ckpt, total, skip=keys.GROUP_REWARD)]
    try:
        # No reward stage yet: the whole window piles up, undelivered, in front of it.
        _wait(lambda: r.xlen(keys.rollouts(job)) >= 12, 60, "a backlog before the reward stage")
        # A slow reward stage: holds each batch (pending) while the feeder keeps trimming.
        procs.append(_spawn(redis_server.url, job, "stage", "--group", keys.GROUP_REWARD, "--hold-s", "0.3"))
        pending = lambda: r.xpending(keys.rollouts(job), keys.GROUP_REWARD)["pending"]  # noqa: E731
        _wait(lambda: pending() > 0, 30, "the slow stage to hold entries")
        assert r.xlen(keys.rollouts(job)) >= 12 and audit(r, job).balanced
        _wait(lambda: read_ledger(r, job).get("trained", 0) >= total, 120, f"all {total} groups to be trained")
        _wait(lambda: procs[0].poll() is not None, 30, "the feeder to finish")
    finally:
        _kill(*procs)
    assert sorted(_trained(ckpt)) == sorted(f"{job}:g{i}" for i in range(total))
    a = audit(r, job)
    assert a.balanced and a.in_flight == 0, a.problems
    assert all(r.xlen(s) == 0 for s in keys.job_streams(job))


def test_a_refusal_stops_the_server_and_the_heartbeat_before_it_exits(tmp_path):
    """Exit 2 only once the runtime's threads have stopped: raised with the uvicorn thread still
    live, the interpreter's exit raced it and a refused reward service died of SIGSEGV (-11)
    instead of exiting 2, once in CI (the test below)."""
    from services.api.settings import ApiSettings
    from services.cli.launch import free_port
    from shared.service import ServiceRuntime

    srv = RedisServer(tmp_path, policy="allkeys-lru")
    srv.start()
    try:
        rt = ServiceRuntime("api", ApiSettings(redis_url=srv.url, dev=True, port=free_port()))
        before = set(threading.enumerate())
        rt.start()
        with pytest.raises(SystemExit) as refused:
            rt.preflight()
        assert refused.value.code == 2
        assert sorted(t.name for t in set(threading.enumerate()) - before) == []
    finally:
        srv.kill()


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_an_evicting_server_is_refused_at_startup(tmp_path, policy):
    """A service process itself refuses (exit 2 with the fix in its log), not just the check."""
    srv = RedisServer(tmp_path, policy=policy)
    srv.start()
    try:
        env = {**os.environ, "REDIS_URL": srv.url, "BURSTRL_DEV": "1", "BURSTRL_PORT": "0"}
        env["STORE_URL"] = f"file://{tmp_path / 'store'}"
        p = subprocess.run(
            [sys.executable, "-m", "services.reward"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert p.returncode == 2
        assert "noeviction" in p.stderr
    finally:
        srv.kill()
