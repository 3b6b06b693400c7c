"""The tracker bridge: a job's metric points in (real) Redis -> TensorBoard / W&B offline /
MLflow file store, each read back with the tracker's own reader; nothing forwarded twice.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.api import jobs
from services.api.app import build_routes
from services.api.settings import ApiSettings
from services.cli.track import ApiSource, RedisSource, flatten, open_bridge, run_bridge
from shared import keys
from shared.job import JobSpec, JobState, set_state
from shared.metrics import record_eval, record_point
from shared.service import ServiceRuntime

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "trackers-test-token-0123456789"


def _seed(r, steps: int = 4) -> str:
    rec = jobs.create_job(r, spec=JobSpec(name="trk", base_model="m", steps=steps))
    for step in range(1, steps + 1):
        record_point(
            r,
            rec.id,
            "trainer",
            {"step": step, "reward_mean": 0.1 * step, "reward_parts": {"correct": 0.05 * step}, "loss": 1.0 / step},
        )
        record_point(r, rec.id, "rollout", {"groups": 8, "seconds": 2.0, "engine": "vllm"})  # text is skipped
    for v in range(2):
        record_eval(r, rec.id, v, {"accuracy": 0.25 * (v + 1), "greedy_accuracy": 0.5})
    return rec.id


def _finish(r, job_id: str, version: int) -> None:
    set_state(r, job_id, JobState.completed, only_from={JobState.running})
    r.set(keys.policy_pointer(job_id), version)


def _tb_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_flatten_keeps_numeric_leaves():
    assert flatten({"a": 1, "b": {"c": 2.5, "d": "x"}, "e": True, "f": float("nan")}) == {"a": 1, "b/c": 2.5, "e": 1}


def test_tensorboard_from_redis_resumes_without_duplicates(r, redis_server, tmp_path):
    pytest.importorskip("tensorboard")
    job_id = _seed(r)
    out = tmp_path / "tb"
    bridge = open_bridge(RedisSource(redis_server.url, job_id), job_id, "tensorboard", str(out))
    n = bridge.sync()
    bridge.close()
    # 4 trainer points x 3 scalars + 4 rollout points x 2 + 2 evals x 2
    assert n == 12 + 8 + 4
    # New points after a restart of the bridge: only they are forwarded.
    record_point(r, job_id, "trainer", {"step": 5, "reward_mean": 0.5, "loss": 0.2})
    record_eval(r, job_id, 2, {"accuracy": 0.9, "greedy_accuracy": 0.95})
    _finish(r, job_id, 2)
    status = run_bridge(
        open_bridge(RedisSource(redis_server.url, job_id), job_id, "tensorboard", str(out)), follow=True, interval_s=0.1
    )
    assert status["state"] == "completed"
    scalars = _tb_scalars(out / job_id)
    assert scalars["trainer/reward_mean"] == [(s, pytest.approx(0.1 * s)) for s in range(1, 6)]
    assert [s for s, _ in scalars["trainer/reward_parts/correct"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["rollout/groups"]] == [0, 1, 2, 3]  # no step: per-source counter
    assert scalars["eval/accuracy"] == [(0, 0.25), (1, 0.5), (2, pytest.approx(0.9))]
    assert "rollout/engine" not in scalars


def test_tensorboard_through_the_api(r, redis_server, tmp_path):
    pytest.importorskip("tensorboard")
    job_id = _seed(r)
    rt = ServiceRuntime("api", ApiSettings(redis_url=redis_server.url, token=TOKEN))
    with TestClient(build_routes(rt)) as client:
        source = ApiSource("http://testserver", job_id, {"Authorization": f"Bearer {TOKEN}"}, client=client)
        bridge = open_bridge(source, job_id, "tensorboard", str(tmp_path / "tb"))
        assert bridge.sync() == 24
        assert bridge.sync() == 0  # nothing new, nothing re-sent
        bridge.close()
    assert len(_tb_scalars(tmp_path / "tb" / job_id)["trainer/loss"]) == 4


def _wandb_history(root: Path) -> list[dict[str, str]]:
    """History rows of an offline W&B run, read from its .wandb file (LevelDB-style log of
    protobuf records: 7-byte header, 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = root.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            break
        buf += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item})
            buf = b""
    return rows


def test_wandb_offline(r, redis_server, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    job_id = _seed(r, steps=3)
    bridge = open_bridge(RedisSource(redis_server.url, job_id), job_id, "wandb", str(tmp_path / "wb"))
    bridge.sync()
    bridge.close()
    # wandb's service process may still be writing the run file when finish() returns (one
    # CI run under load read it empty): read until the history is there, or 30 s.
    deadline = time.monotonic() + 30
    while True:
        try:
            rows = _wandb_history(tmp_path / "wb")
        except Exception:  # noqa: BLE001 - a record half written: read again
            if time.monotonic() > deadline:
                raise
            rows = []
        trainer = [row for row in rows if "trainer/reward_mean" in row]
        if len(trainer) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [int(row["trainer/step"]) for row in trainer] == [1, 2, 3]
    assert float(trainer[-1]["trainer/reward_mean"]) == pytest.approx(0.3)
    assert [float(row["eval/accuracy"]) for row in rows if "eval/accuracy" in row] == [0.25, 0.5]


def test_mlflow_file_store(r, redis_server, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    job_id = _seed(r, steps=3)
    out = tmp_path / "mlruns"
    for _ in range(2):  # the second run finds the same MLflow run and sends nothing new
        bridge = open_bridge(RedisSource(redis_server.url, job_id), job_id, "mlflow", str(out))
        bridge.sync()
        bridge.close()
    client = MlflowClient(tracking_uri=out.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("burstrl").experiment_id])
    hist = client.get_metric_history(run.info.run_id, "trainer/reward_mean")
    assert sorted((m.step, round(m.value, 6)) for m in hist) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert len(client.get_metric_history(run.info.run_id, "eval/accuracy")) == 2


def test_cli_track_command(r, redis_server, tmp_path):
    pytest.importorskip("tensorboard")
    job_id = _seed(r, steps=2)
    out = tmp_path / "tb"
    cmd = [sys.executable, "-m", "services.cli.main", "track", job_id, "--to", "tensorboard"]
    cmd += ["--dir", str(out), "--redis", redis_server.url]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "forwarded" in res.stdout
    assert len(_tb_scalars(out / job_id)["trainer/reward_mean"]) == 2
    bad = subprocess.run([*cmd[:5], "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2


def test_submit_follow_track_tensorboard(r, redis_server, tmp_path):
    """`burstrl submit --follow --track tensorboard` against a real api process."""
    pytest.importorskip("tensorboard")
    from services.cli.launch import Launcher, free_port

    launcher = Launcher(tmp_path / "run")
    port = free_port()
    env = {"REDIS_URL": redis_server.url, "BURSTRL_TOKEN": TOKEN, "BURSTRL_DEV": "0"}
    launcher.start_service("api", env, port=port)
    try:
        launcher.wait_ready(["api"], timeout=60)
        job_toml = tmp_path / "job.toml"
        job_toml.write_text('name = "follow"\nbase_model = "m"\nsteps = 2\n')
        out = tmp_path / "tb"
        cmd = [sys.executable, "-m", "services.cli.main", "submit", str(job_toml), "--follow"]
        cmd += ["--track", "tensorboard", "--track-dir", str(out)]
        cli_env = {**os.environ, "BURSTRL_API_URL": f"http://127.0.0.1:{port}", "BURSTRL_TOKEN": TOKEN}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + 30
            while not r.hlen(keys.jobs_index()) and time.time() < deadline:
                time.sleep(0.1)
            (job_id,) = [k.decode() for k in r.hkeys(keys.jobs_index())]
            # What the trainer and rollout would record, then the job completes.
            for step in (1, 2):
                record_point(r, job_id, "trainer", {"step": step, "reward_mean": 0.4 * step, "loss": 0.5})
                record_eval(r, job_id, step, {"accuracy": 0.3 * step, "greedy_accuracy": 0.5})
            _finish(r, job_id, 2)
            output, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, output
        assert "tracking to tensorboard" in output
        scalars = _tb_scalars(out / job_id)
        assert [s for s, _ in scalars["trainer/reward_mean"]] == [1, 2]
        assert [s for s, _ in scalars["eval/accuracy"]] == [1, 2]
    finally:
        launcher.stop_all()
