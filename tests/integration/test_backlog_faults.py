"""Backlog faults with real processes, a real redis-server and a real S3-protocol server (moto).

Each ends with nothing lost, nothing trained twice and the ledger balanced (shared.ledger.audit):
- a spilling rollout replica killed with kill -9 between a segment's data and its manifest,
  and between its manifest and the script that indexes it;
- the trainer killed with kill -9 in the middle of a segment (the final weights are those of an
  uninterrupted run: bit-identical on CPU);
- the object store unreachable during spills: rollout pauses spilling and says so (/readyz, log);
- Redis killed and restarted from its AOF while a backlog exists;
- a backlog at its budget: rollout's /readyz names the job and the budget, nothing is dropped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

import services.rollout.spill as spill_mod
from services.api.feeder import Feeder
from services.cli.launch import free_port
from services.trainer.checkpoint import checkpoint_steps, load_checkpoint
from services.trainer.policy import ADAPTER_WEIGHTS
from shared import keys
from shared.backlog import read_index
from shared.bus import Bus
from shared.job import JobState, load_job
from shared.ledger import audit
from shared.metrics import read_ledger
from shared.segments import stored_segments
from shared.store import FileStore, open_store
from tests.support.backlog import Drain, group, new_job, push_ready, roll, runtime, spec, spiller
from tests.support.jobs import insert_running, small_spec
from tests.support.proxy import TcpProxy
from tests.support.servers import RedisServer, make_bucket
from tests.support.stack import readyz, wait_for

ROOT = Path(__file__).resolve().parents[2]


class Procs:
    """Processes this test started, each with its log; stopped by pid at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs, self.logs = tmp, {}, {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.logs[name] = self.tmp / f"{name}.log"
        with self.logs[name].open("wb") as f:
            p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def kill9(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def stop(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def alive(self, name: str) -> bool:
        assert self.procs[name].poll() is None, f"{name} exited:\n{self.log(name)[-3000:]}"
        return True

    def close(self) -> None:
        for name in self.procs:
            self.stop(name)


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


def spill_env(redis_url: str, store_url: str, replica: str, model: str, port: int, **extra: str) -> dict[str, str]:
    return {
        "REDIS_URL": redis_url,
        "STORE_URL": store_url,
        "BURSTRL_DEV": "1",
        "BURSTRL_PORT": str(port),
        "BURSTRL_REPLICA": replica,
        "BURSTRL_ROLLOUT_MODEL": model,
        "BURSTRL_HEARTBEAT_S": "0.5",  # a killed replica's heartbeat expires within ~3 s
        **extra,
    }


def _pending_to_spillers(r, job_id: str) -> int:
    consumers = r.xinfo_consumers(keys.ready(job_id), keys.GROUP_TRAINER)
    return sum(int(c["pending"]) for c in consumers if c["name"].decode().startswith(keys.SPILL_CONSUMER))


def _ids(job_id: str, n: int) -> list[str]:
    return sorted(f"{job_id}:g{i}" for i in range(n))


def _balanced(r, job_id: str) -> None:
    a = audit(r, job_id)
    assert a.balanced, a.problems


def _readyz(port: int) -> dict:
    return readyz(port)[1]


# -- rollout killed in the middle of a spill ------------------------------------------
@pytest.mark.parametrize("point", ["before_manifest", "after_manifest"])
def test_rollout_killed_mid_spill_spills_each_group_once(r, redis_server, tmp_path, procs, monkeypatch, point):
    store = FileStore(tmp_path / "store")
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(40)])  # 8 stay hot, 32 spill
    marker = tmp_path / "marker"
    model = rec.spec.base_model
    env = spill_env(redis_server.url, store.url, "a", model, free_port(), BURSTRL_TEST_SPILL_PAUSE=point)
    procs.start("a", [sys.executable, "tests/support/spill_proc.py"], {**env, "BURSTRL_TEST_SPILL_MARKER": str(marker)})
    wait_for(lambda: marker.exists() and procs.alive("a"), 120, "replica a in the middle of its first spill")
    procs.kill9("a")
    torn = marker.read_text()
    # Its first pass took every segment beyond the hot window (4, written 4 at once): none indexed.
    assert read_index(r, rec.id) == {} and _pending_to_spillers(r, rec.id) == 32
    _balanced(r, rec.id)
    procs.start(
        "b",
        [sys.executable, "-m", "services.rollout.spill"],
        spill_env(redis_server.url, store.url, "b", model, free_port()),
    )
    wait_for(
        lambda: (
            procs.alive("b") and read_ledger(r, rec.id).get("spilled") == 32 and not _pending_to_spillers(r, rec.id)
        ),
        120,
        "replica b to take a's entries over and spill everything",
    )
    procs.stop("b")
    orphans = set(stored_segments(store, rec.id)) - set(read_index(r, rec.id))
    assert torn in orphans and len(read_index(r, rec.id)) == 4  # a's segments are orphans, b's indexed
    d = Drain(r, store, rec)
    got = d.all(40, timeout=60)
    d.close()
    assert len(got) == 40 and sorted(got) == _ids(rec.id, 40)  # each group once, the orphans' never
    _balanced(r, rec.id)
    monkeypatch.setattr(spill_mod, "ORPHAN_AGE_S", 0.0)
    assert spiller(runtime(redis_server.url), store).sweep_orphans(rec.id) == len(orphans)
    assert stored_segments(store, rec.id) == []


# -- the trainer killed in the middle of a segment --------------------------------------
KJOB = "bl-kill"
KSTEPS, KBATCH = 18, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shared.ml.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, seed=0)


def _trainer_world(r, redis_url: str, tmp: Path, model_dir: Path) -> FileStore:
    """36 ready groups: 4 in the hot window, 32 in four segments of 8, trained oldest first."""
    r.flushall()
    store = FileStore(tmp / "store")
    backlog = {"max_groups": 64, "segment_groups": 8}
    s = small_spec(model_dir, name="blkill", group=4, batch=KBATCH, steps=KSTEPS, learning_rate=5e-3, backlog=backlog)
    insert_running(r, KJOB, s)
    r.sadd(keys.active_jobs(), KJOB)
    Bus.ensure_groups(r, KJOB)
    push_ready(r, KJOB, [group(KJOB, i) for i in range(KSTEPS * KBATCH)])
    assert spiller(runtime(redis_url), store).tick() == 32
    return store


def _trainer_env(redis_url: str, store: FileStore, replica: str) -> dict[str, str]:
    return {
        "REDIS_URL": redis_url,
        "STORE_URL": store.url,
        "BURSTRL_DEV": "1",
        "BURSTRL_PORT": str(free_port()),
        "BURSTRL_REPLICA": replica,
        "BURSTRL_TRAINER_JOB": KJOB,
        "BURSTRL_TRAINER_DEVICE": "cpu",
        "BURSTRL_TRAINER_CHECKPOINT_EVERY": "1",
        "BURSTRL_TRAINER_KEEP_CHECKPOINTS": "50",
        "BURSTRL_TRAINER_THREADS": "1",
        "BURSTRL_TRAINER_LEASE_S": "5",
    }


def _final_weights(store: FileStore) -> dict[str, torch.Tensor]:
    assert max(checkpoint_steps(store, KJOB)) == KSTEPS
    return load(load_checkpoint(store, KJOB, KSTEPS).files[ADAPTER_WEIGHTS])


def _mid_segment(r) -> bool:
    return any(0 < i.remaining < i.groups for i in read_index(r, KJOB).values())


@pytest.mark.slow
def test_trainer_killed_mid_segment_trains_each_group_once(r, redis_server, tmp_path, procs, model_dir):
    trainer = [sys.executable, "-m", "services.trainer"]
    done = lambda: load_job(r, KJOB).state == JobState.completed  # noqa: E731
    # The uninterrupted run, also a real process (same threads, same code path).
    store = _trainer_world(r, redis_server.url, tmp_path / "ref", model_dir)
    procs.start("ref", trainer, _trainer_env(redis_server.url, store, "ref"))
    wait_for(lambda: procs.alive("ref") and done(), 400, "the uninterrupted run")
    procs.stop("ref")
    want = _final_weights(store)
    # The same world, the trainer killed while a segment is partly acknowledged.
    store = _trainer_world(r, redis_server.url, tmp_path / "kill", model_dir)
    procs.start("a", trainer, _trainer_env(redis_server.url, store, "a"))
    wait_for(lambda: procs.alive("a") and _mid_segment(r), 400, "trainer a in the middle of a segment", poll_s=0.02)
    procs.kill9("a")
    trained_at_kill = read_ledger(r, KJOB)["trained"]
    assert 0 < trained_at_kill < KSTEPS * KBATCH
    procs.start("b", trainer, _trainer_env(redis_server.url, store, "b"))  # waits out a's lease (5 s)
    wait_for(lambda: procs.alive("b") and done(), 400, "trainer b to finish the job")
    procs.stop("b")
    got = _final_weights(store)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k  # nothing trained twice, nothing skipped
    led = read_ledger(r, KJOB)
    assert led["trained"] == KSTEPS * KBATCH and led["in_flight"] == 0, led
    assert read_index(r, KJOB) == {} and stored_segments(store, KJOB) == []
    _balanced(r, KJOB)


# -- a store outage during spills -------------------------------------------------------
def test_a_store_outage_pauses_spilling_says_so_and_loses_nothing(r, redis_server, s3_endpoint, tmp_path, procs):
    make_bucket(s3_endpoint, "bl-outage")
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    proxy.up()
    store_url = "s3://bl-outage/backlog"
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(24)])
    port = free_port()
    env = spill_env(redis_server.url, store_url, "s", rec.spec.base_model, port)
    procs.start(
        "s",
        [sys.executable, "-m", "services.rollout.spill"],
        {**env, "STORE_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"},
    )
    wait_for(lambda: procs.alive("s") and read_ledger(r, rec.id).get("spilled") == 16, 120, "the first spills")
    proxy.down()
    push_ready(r, rec.id, [group(rec.id, i) for i in range(24, 40)])
    check = wait_for(
        lambda: procs.alive("s") and (c := _readyz(port)["checks"].get("spill")) and not c["ok"] and c,
        120,
        "rollout to say it paused spilling",
    )
    assert "spilling paused" in check["reason"] and store_url in check["reason"] and check["scope"] == "job"
    body = _readyz(port)
    assert body["ready"] and body["degraded"]  # generation goes on into the hot window
    assert "spilling paused" in procs.log("s")
    assert read_ledger(r, rec.id)["spilled"] == 16
    _balanced(r, rec.id)  # the entries it could not spill wait, pending, in Redis
    proxy.up()
    wait_for(
        lambda: (
            procs.alive("s") and read_ledger(r, rec.id).get("spilled") == 32 and _readyz(port)["checks"]["spill"]["ok"]
        ),
        180,
        "spilling to resume once the store is back",
    )
    procs.stop("s")
    store = open_store(store_url)  # the trainer's side reads s3:// straight from the server
    d = Drain(r, store, rec)
    got = d.all(40, timeout=60)
    d.close()
    assert len(got) == 40 and sorted(got) == _ids(rec.id, 40)
    _balanced(r, rec.id)


# -- Redis restarted from its AOF while a backlog exists -----------------------------------
def test_redis_restarted_from_its_aof_with_a_backlog_loses_nothing(tmp_path, procs):
    (tmp_path / "redis").mkdir()
    srv = RedisServer(tmp_path / "redis")
    srv.start()
    try:
        r = srv.client()
        store = FileStore(tmp_path / "store")
        rec = new_job(r, spec())
        push_ready(r, rec.id, [group(rec.id, i) for i in range(40)])
        env = spill_env(srv.url, store.url, "s", rec.spec.base_model, free_port())
        procs.start("s", [sys.executable, "-m", "services.rollout.spill"], env)
        wait_for(lambda: procs.alive("s") and read_ledger(r, rec.id).get("spilled") == 32, 120, "the spills")
        d = Drain(r, store, rec)
        first = d.all(5)  # a segment partly trained: its done bitmap must survive
        assert len(first) == 5
        d.close()
        push_ready(r, rec.id, [group(rec.id, i) for i in range(40, 64)])  # spilling as Redis dies
        srv.kill()
        srv.start()  # the same port and data directory: the AOF
        r = srv.client()
        assert len(read_index(r, rec.id)) >= 3
        wait_for(
            lambda: (
                procs.alive("s")
                and read_ledger(r, rec.id).get("spilled", 0) == 56
                and not _pending_to_spillers(r, rec.id)
            ),
            120,
            "the spiller to carry on after the restart",
        )
        procs.stop("s")
        fed = read_ledger(r, rec.id)["fed"]  # what Redis still knows was fed (everything, with the AOF)
        d2 = Drain(r, store, rec)
        rest = d2.all(fed - 5, timeout=60)
        d2.close()
        got = first + rest
        assert len(got) == len(set(got)) == fed == 64  # nothing lost, nothing twice
        _balanced(r, rec.id)
    finally:
        srv.kill()


# -- a backlog at its budget -----------------------------------------------------------------
def test_a_backlog_at_its_budget_makes_rollout_idle_and_say_why(r, redis_server, tmp_path, procs):
    store = FileStore(tmp_path / "store")
    rec = new_job(r, spec(max_groups=32, segment_groups=8))
    port = free_port()
    procs.start(
        "s",
        [sys.executable, "-m", "services.rollout.spill"],
        spill_env(redis_server.url, store.url, "s", rec.spec.base_model, port),
    )
    feeder = Feeder(r, store)
    deadline = time.time() + 120
    while time.time() < deadline:  # the api feeds, rollout generates, the spiller spills, no trainer
        feeder.tick()
        roll(r, rec.id)
        led = read_ledger(r, rec.id)
        if led["fed"] == 8 + 32 and led.get("produced") == 40:
            break
        time.sleep(0.2)
    assert feeder.tick() == 0 and roll(r, rec.id) == 0  # nothing more to do: rollout idles
    check = wait_for(
        lambda: procs.alive("s") and (c := _readyz(port)["checks"].get(f"backlog:{rec.id}")) and not c["ok"] and c,
        60,
        "rollout's /readyz to say the backlog is full",
    )
    assert rec.id in check["reason"] and "group budget" in check["reason"] and check["scope"] == "job"
    procs.stop("s")
    led = read_ledger(r, rec.id)
    assert led.get("dead", 0) == 0 and not any(k.startswith("dropped") for k in led), led
    _balanced(r, rec.id)
    # A trainer takes groups: room opens and the feeder feeds again.
    d = Drain(r, store, rec)
    assert len(d.all(8)) == 8
    d.close()
    assert feeder.tick() == 8


def test_a_store_the_trainer_cannot_reach_leaves_it_training_the_hot_stream(r, redis_server, s3_endpoint, monkeypatch):
    """Segments it cannot read now are tried again later; meanwhile the hot window is trained."""
    make_bucket(s3_endpoint, "bl-readout")
    store = open_store("s3://bl-readout/backlog")
    rec = new_job(r, spec())
    push_ready(r, rec.id, [group(rec.id, i) for i in range(40)])
    assert spiller(runtime(redis_server.url), store).tick() == 32
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    proxy.up()
    monkeypatch.setenv("STORE_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    behind_proxy = open_store("s3://bl-readout/backlog")  # the trainer's view of the store
    proxy.down()
    d = Drain(r, behind_proxy, rec)
    hot = d.all(8, timeout=120)
    assert sorted(hot) == sorted(f"{rec.id}:g{i}" for i in range(32, 40))  # oldest first, but the store is away
    proxy.up()
    got = d.all(40, timeout=120)
    d.close()
    assert len(got) == 40 and sorted(got) == _ids(rec.id, 40)
    _balanced(r, rec.id)
