"""Fixtures: real redis-server and S3 (moto) processes on free ports, the tiny model, and
`service_stack` (a RedisServer plus the services as processes, for the end-to-end tests).

Every process a fixture starts is stopped by its pid at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from services.cli.launch import Launcher, free_port, port_open, terminate
from services.cli.stack import stack_env

ROOT = Path(__file__).resolve().parents[1]

# How far two fp32 computations of the same per-token log-probs may differ when only the batch
# shape differs (batch size, padding, micro-batch split, thread count): the BLAS kernels sum in
# another order, each step off by up to ~1.2e-7 relative, compounded through the layers and
# scaled by the logits. The worst seen: 2.0e-5 nats (one machine's locally built tiny model),
# 1.9e-6 under load. The bound below is 5x that; a real batching bug (padding attended to, a
# shifted position, a wrong mask) moves log-probs by 0.1 nats or more, 1000x above it.
FP32_LOGPROB_TOL = {"abs": 1e-4, "rel": 1e-5}
MODEL_CACHE = Path(os.environ.get("BURSTRL_TEST_MODEL", ROOT / ".burstrl" / "models" / "tiny-sft"))


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while not port_open(port):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{what} did not start on port {port}")
        time.sleep(0.1)


class RedisServer:
    """A redis-server we own (AOF everysec), restartable on the same port and data."""

    def __init__(self, tmp: Path, policy: str = "noeviction") -> None:
        self.port = free_port()
        self.dir = tmp
        self.policy = policy
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server must be installed (make install does it)"
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                self.policy,
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait_port(self.port, self.proc, "redis-server")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A clean database per test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on loopback; a real HTTP S3 protocol peer."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait_port(port, proc, "moto S3 server")
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "STORE_ENDPOINT_URL": endpoint,
        }
    )
    yield endpoint
    terminate(proc.pid, 5)


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny SFT'd model, built once and cached under .burstrl/ (as `make demo` does)."""
    from shared.ml.models import ensure_tiny_model

    return ensure_tiny_model(MODEL_CACHE)


def wait_for(pred, timeout: float, what: str, launcher=None, poll_s: float = 0.5):  # noqa: ANN001
    """Poll `pred` until it returns something truthy; on timeout fail with the services' log tails."""
    from services.cli.launch import tail

    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    logs = "\n".join(f"--- {n}\n{tail(p.log, 15)}" for n, p in launcher.procs().items()) if launcher else ""
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


@dataclass
class ServiceStack:
    """What `service_stack` started: the launcher of the services, their env and ports, and
    the RedisServer (tests may kill and restart services or Redis through these)."""

    launcher: Launcher
    redis: RedisServer
    env: dict[str, str]
    ports: dict[str, int]
    started_at: float  # time.time() just before the first service was started

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    @property
    def api(self) -> str:
        return self.url("api")


@contextmanager
def service_stack(
    tmp_path: Path,
    model: Path | str,
    roles: Sequence[str],
    *,
    env_extra: Mapping[str, str] | None = None,
    role_env: Mapping[str, Mapping[str, str]] | None = None,
    store_url: str | None = None,
    ready_timeout: float = 400,
) -> Iterator[ServiceStack]:
    """A RedisServer (data in tmp_path/redis-data) and `roles` as processes on free ports, with
    `stack_env(tmp_path, model, redis, store_url)` plus `env_extra` (and `role_env[role]` for that
    role only), ready within `ready_timeout` s. On exit the services are stopped, then Redis."""
    (tmp_path / "redis-data").mkdir()
    srv = RedisServer(tmp_path / "redis-data")
    srv.start()
    try:
        launcher = Launcher(tmp_path / "run")
        env = {**stack_env(tmp_path, str(model), srv.url, store_url=store_url), **(env_extra or {})}
        ports = {role: free_port() for role in roles}
        stack = ServiceStack(launcher, srv, env, ports, time.time())
        try:
            for role in roles:
                launcher.start_service(role, {**env, **(role_env or {}).get(role, {})}, port=ports[role])
            launcher.wait_ready(list(roles), timeout=ready_timeout)
            yield stack
        finally:
            launcher.stop_all()
    finally:
        srv.kill()
