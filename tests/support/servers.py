"""Real servers the tests own: a redis-server (AOF, restartable on the same port and data) and
moto's standalone S3 server, each on a free loopback port and stopped by its pid."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import redis

from services.cli.launch import free_port, port_open, terminate
from tests.support.waits import Deadline


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20) -> None:
    deadline = Deadline(timeout)
    while not port_open(port):
        if proc.poll() is not None or not deadline:
            raise RuntimeError(f"{what} did not start on port {port}")
        time.sleep(0.1)


def spawn_redis(port: int, data_dir: Path, *args: str) -> subprocess.Popen:
    """A redis-server on loopback `port` in its own session (stopped by pid), AOF everysec in
    `data_dir`, no RDB snapshots; `args` add or override settings."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server must be installed (make install does it)"
    settings = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir)]
    settings += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
    return subprocess.Popen(
        [exe, *settings, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


class RedisServer:
    """A redis-server we own (AOF everysec), restartable on the same port and data."""

    def __init__(self, tmp: Path, policy: str = "noeviction") -> None:
        self.port = free_port()
        self.dir = tmp
        self.policy = policy
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = spawn_redis(self.port, self.dir, "--maxmemory-policy", self.policy)
        _wait_port(self.port, self.proc, "redis-server")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def start_s3() -> tuple[subprocess.Popen, str]:
    """moto's standalone S3 server on loopback (a real HTTP S3 protocol peer): (process, endpoint)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait_port(port, proc, "moto S3 server")
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    terminate(proc.pid, 5)


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
