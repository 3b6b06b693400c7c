"""A real Redis Cluster the tests own: N masters (and optionally one replica each) on free
loopback ports, each a `redis-server --cluster-enabled yes` in its own folder, joined by
`redis-cli --cluster create`, and stopped by pid. Nodes can be killed one by one (failover).

Clients dial it through `url` (`redis+cluster://...`, shared/redis_conn.py).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.cli.launch import free_port, terminate
from tests.support.servers import _wait_port, spawn_redis
from tests.support.waits import Deadline


@dataclass
class ClusterNode:
    port: int
    bus_port: int  # not port + 10000: that may pass 65535
    dir: Path
    proc: subprocess.Popen | None = None

    def cli(self, *args: str) -> str:
        exe = shutil.which("redis-cli")
        assert exe
        return subprocess.run(
            [exe, "-p", str(self.port), *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout

    def cluster_info(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.cli("CLUSTER", "INFO").splitlines():
            k, sep, v = line.strip().partition(":")
            if sep:
                out[k] = v
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class RedisCluster:
    """`masters` masters, each with `replicas` replicas (0 or 1), under `tmp`."""

    tmp: Path
    masters: int = 3
    replicas: int = 0
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def start(self) -> None:
        for i in range(self.masters * (1 + self.replicas)):
            node = ClusterNode(free_port(), free_port(), self.tmp / f"node{i}")
            node.dir.mkdir(parents=True, exist_ok=True)
            self._spawn(node)
            self.nodes.append(node)
        for node in self.nodes:
            assert node.proc is not None
            _wait_port(node.port, node.proc, "redis-server (cluster node)")
        cli = shutil.which("redis-cli")
        assert cli
        made = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in self.nodes],
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=60,
        )
        if made.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {made.stdout[-2000:]} {made.stderr[-2000:]}")
        self.wait_ok()

    def _spawn(self, node: ClusterNode) -> None:
        node.proc = spawn_redis(
            node.port,
            node.dir,
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-port", str(node.bus_port), "--cluster-node-timeout", "1000"),
            *("--maxmemory-policy", "noeviction"),
        )

    def restart(self, node: ClusterNode) -> None:
        """Start a killed node again on its port, folder and nodes.conf (its id and slots)."""
        self._spawn(node)
        assert node.proc is not None
        _wait_port(node.port, node.proc, "redis-server (cluster node)")
        self.wait_ok()

    def wait_ok(self, timeout: float = 60) -> None:
        """Until every live node says cluster_state:ok and knows `masters` masters with slots."""
        deadline = Deadline(timeout)
        while True:
            live = [n for n in self.nodes if n.alive()]
            try:
                if all(n.cluster_info().get("cluster_state") == "ok" for n in live) and all(
                    len(self.masters_seen(n)) == self.masters for n in live
                ):
                    return
            except subprocess.SubprocessError:
                pass
            if not deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.2)

    def masters_seen(self, node: ClusterNode) -> list[str]:
        """Node ids of the masters holding slots, as `node` sees them (CLUSTER NODES)."""
        out = []
        for line in node.cli("CLUSTER", "NODES").splitlines():
            parts = line.split()
            if len(parts) > 8 and "master" in parts[2] and "fail" not in parts[2]:
                out.append(parts[0])
        return out

    def master_of_slot(self, slot: int) -> ClusterNode:
        """The live node serving `slot` as master."""
        for node in self.nodes:
            if not node.alive():
                continue
            for line in node.cli("CLUSTER", "NODES").splitlines():
                parts = line.split()
                if "myself" not in parts[2] or "master" not in parts[2]:
                    continue
                for rng in parts[8:]:
                    lo, _, hi = rng.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return node
        raise LookupError(f"no live master serves slot {slot}")

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL one node (a crashed master)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                terminate(node.proc.pid, 5)
