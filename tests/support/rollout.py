"""The rollout harness, shared by the rollout tests and benchmarks (bench/rollout_*.py): jobs, real
LoRA and full versions, a vLLM server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import redis

from shared import keys
from shared.bus import Bus
from shared.folders import folder_file
from shared.job import JobRecord, JobSpec, JobState, insert_job
from shared.lease import Lease
from shared.policy import MANIFEST, Manifest, advance_pointer, init_pointer, publish_version, version_prefix
from shared.store import FileStore, ObjectStore
from tests.support.waits import Deadline

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

    from services.rollout.engine import Engine
    from services.rollout.worker import RolloutWorker


def add_job(r: redis.Redis, model: str, name: str = "t", **spec: object) -> JobRecord:
    """A running job as the api would create it (without importing the api)."""
    now = time.time()
    rec = JobRecord(
        id=f"{name}-{os.urandom(3).hex()}",
        spec=JobSpec(name=name, base_model=model, **spec),
        state=JobState.running,
        created_at=now,
        updated_at=now,
    )
    Bus.ensure_groups(r, rec.id)
    insert_job(r, rec)
    init_pointer(r, rec.id)
    r.sadd(keys.active_jobs(), rec.id)
    return rec


def lora_version(model_dir: str, seed: int, rank: int = 8, task: str = "arith") -> tuple[dict[str, bytes], dict]:
    """Adapter files of a LoRA with random (seeded) weights, and its probe, as the trainer makes them."""
    import torch

    from services.trainer.policy import adapter_files, load_policy
    from services.trainer.probe import compute_probe

    model, tok = load_policy(model_dir, rank=rank, alpha=2 * rank, device="cpu", seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero (an identity adapter): make it matter
                p.normal_(0.0, 0.05)
    return adapter_files(model, model_dir), compute_probe(model, tok, task)


def lora_versions(model_dir: str, seeds: list[int], rank: int = 8, task: str = "arith") -> list[tuple[dict, dict]]:
    """Like `lora_version` for many seeds, loading the model once."""
    import torch

    from services.trainer.policy import adapter_files, load_policy
    from services.trainer.probe import compute_probe

    model, tok = load_policy(model_dir, rank=rank, alpha=2 * rank, device="cpu", seed=0)
    out = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        out.append((adapter_files(model, model_dir), compute_probe(model, tok, task)))
    return out


def full_version(model_dir: str, seed: int, scale: float = 0.02, task: str = "arith") -> tuple[dict[str, bytes], dict]:
    """Full-weight version files (the trainer's own `full_files`) of the model with every
    weight matrix perturbed by seeded noise, and its probe: what `finetune = "full"` publishes."""
    import torch

    from services.trainer.policy import full_files, load_policy
    from services.trainer.probe import compute_probe

    model, tok = load_policy(model_dir, rank=8, alpha=16, device="cpu", seed=0, finetune="full")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # linear and embedding matrices: what the CPU backend repacks
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    return full_files(model), compute_probe(model, tok, task)


def publish(
    store: ObjectStore, r: redis.Redis, job_id: str, version: int, files: dict[str, bytes], probe: dict, epoch: int = 0
) -> None:
    """Publish a version and move the job's policy pointer, as the trainer does (holding its
    lease). `epoch`: the lease epoch its manifest carries (shared/fence.py)."""
    m = Manifest(job_id=job_id, version=version, step=version, base_model="", files={}, probe=probe, epoch=epoch)
    publish_version(store, m, files)
    lease = Lease(r, job_id, "bench-trainer", 60)
    if not lease.acquire():
        raise RuntimeError(f"job {job_id}: another trainer holds the lease")
    try:
        advance_pointer(r, job_id, version, lease.fence)
    finally:
        lease.release()


def republish(
    store: ObjectStore, r: redis.Redis, job_id: str, version: int, files: dict[str, bytes], probe: dict, epoch: int = 0
) -> None:
    """Publish an existing version again, as the trainer repairs a corrupt, forged or deposed
    one: its manifest goes first (no reader sees new files under the old one), then the files
    and a new manifest."""
    store.delete(f"{version_prefix(job_id, version)}/{MANIFEST}")
    publish(store, r, job_id, version, files, probe, epoch)


def corrupt(store: ObjectStore, job_id: str, version: int, name: str = "adapter_model.safetensors") -> None:
    """Flip bytes of a published file (the adapter by default): its sha256 no longer matches the manifest."""
    key = folder_file(store, version_prefix(job_id, version), name)
    data = bytearray(store.get(key))
    data[-8:] = b"\x00" * 8
    store.put(key, bytes(data))


def start_vllm_server(model: str, port: int, log: Path, *extra: str, lora: bool = True) -> subprocess.Popen:
    """`python -m vllm.entrypoints.openai.api_server` for the tiny model, runtime LoRA on (CPU);
    `lora` False: a server started without --enable-lora (its adapter routes stay, as in production)."""
    env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4"] if lora else []),
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seed",
        "0",
        # Sample log-probs of the distribution actually sampled from (temperature, top-p).
        "--logprobs-mode",
        "processed_logprobs",
        *extra,
    ]
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_vllm_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = Deadline(timeout)
    while deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM server not up after {timeout}s:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def started_engine(
    mode: str, model: str, workdir: Path, *, max_loras: int = 4, lora: bool = True
) -> Iterator[tuple[Engine, str]]:
    """A started engine of the given mode ("inprocess" | "remote": a vLLM server for it, its log
    in workdir, LoRA off if not `lora`) and, for remote, the server URL; closed (the server
    stopped by pid) on exit."""
    from services.cli.launch import free_port, terminate

    if mode == "inprocess":
        from services.rollout.engine_inprocess import InProcessEngine

        eng = InProcessEngine(
            model=model, max_model_len=256, max_lora_rank=16, max_loras=max_loras, dtype="float32", seed=0
        )
        try:
            yield eng, ""
        finally:
            eng.close()
        return
    from services.rollout.engine_remote import RemoteEngine

    port = free_port()
    log = workdir / "vllm-server.log"
    proc = start_vllm_server(model, port, log, lora=lora)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_vllm_server(url, proc, log)
        eng = RemoteEngine(url=url)
        try:
            yield eng, url
        finally:
            eng.close()
    finally:
        terminate(proc.pid, 20)


@contextlib.contextmanager
def rollout_service(workdir: Path, redis_url: str, model: str, **env: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """`python -m services.rollout` in dev mode on a free port (its log workdir/rollout.log), with
    `env` (BURSTRL_ROLLOUT_* settings) on top; stopped by pid on exit."""
    from services.cli.launch import free_port, terminate

    port = free_port()
    full = {
        **os.environ,
        "BURSTRL_DEV": "1",
        "BURSTRL_PORT": str(port),
        "REDIS_URL": redis_url,
        "STORE_URL": f"file://{workdir / 'store'}",
        "BURSTRL_DATA_DIR": str(workdir),
        "BURSTRL_ROLLOUT_MODEL": model,
        **env,
    }
    with open(workdir / "rollout.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout"],
            env=full,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, port
    finally:
        terminate(proc.pid, 10)


def engine_not_ready(port: int, reason: str, timeout: float, log: Path) -> dict:
    """The rollout service's /readyz body once it answers 503 with `reason` in its engine check."""
    deadline, body = Deadline(timeout), None
    while deadline:
        try:
            resp = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            body = resp.json()
            if resp.status_code == 503 and reason in body["checks"]["engine"]["reason"]:
                return body
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.3)
    raise AssertionError(f"no not-ready with reason: {body}\n{log.read_text()[-2000:]}")


@contextlib.contextmanager
def bench_stack(workdir: Path) -> Iterator[tuple[redis.Redis, str, FileStore]]:
    """An embedded redis-server (stopped by pid at the end) and a file store under workdir."""
    from services.cli.launch import Launcher

    launcher = Launcher(workdir / "run")
    try:
        url = launcher.start_redis()
        yield redis.Redis.from_url(url), url, FileStore(workdir / "store")
    finally:
        launcher.stop_all()


def make_worker(engine: Engine, model: str, redis_url: str, store: FileStore, workdir: Path, **overrides: object):  # noqa: ANN201
    """A RolloutWorker as `python -m services.rollout` builds it, minus the HTTP server."""
    from services.rollout.settings import RolloutSettings
    from services.rollout.worker import RolloutWorker
    from shared.service import ServiceRuntime

    s = RolloutSettings(
        model=model, redis_url=redis_url, store_url=store.url, dev=True, data_dir=workdir / "data", **overrides
    )
    rt = ServiceRuntime("rollout", s)
    rt.health.set("engine", True)
    return RolloutWorker(rt, s, engine, store)


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    ys = sorted(xs)
    pos = (len(ys) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def rollout_worker(
    engine: Engine, model: Path, tmp: Path, redis_url: str, **settings: object
) -> tuple[RolloutWorker, FileStore, TestClient]:
    """A rollout worker on `engine` in dev mode (its store and data under `tmp`, `settings` on
    top), the store, and an HTTP client of its app (/readyz, /metrics)."""
    from fastapi.testclient import TestClient

    from services.rollout.settings import RolloutSettings
    from services.rollout.worker import RolloutWorker
    from shared.service import ServiceRuntime

    s = RolloutSettings(
        model=str(model),
        redis_url=redis_url,
        store_url=f"file://{tmp / 'store'}",
        dev=True,
        data_dir=tmp,
        **settings,
    )
    rt = ServiceRuntime("rollout", s)
    rt.health.set("engine", True)
    store = FileStore(tmp / "store")
    return RolloutWorker(rt, s, engine, store), store, TestClient(rt.app)
