"""Start and stop local processes: an embedded redis-server and the five services.

Used by `burstrl up/down/demo` and by the end-to-end tests, so the tests run exactly
what a user runs. Every process we start is recorded with its pid and stopped by that
pid (never by name). Logs go to <run_dir>/logs/<name>.log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.settings import DEFAULT_PORTS

ROLES = ("api", "reward", "ref", "rollout", "trainer")


@dataclass
class Proc:
    name: str
    pid: int
    port: int
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


class Launcher:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir.resolve()
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.state_file = self.run_dir / "procs.json"

    # -- bookkeeping ------------------------------------------------------------------
    def procs(self) -> dict[str, Proc]:
        if not self.state_file.exists():
            return {}
        raw = json.loads(self.state_file.read_text())
        return {k: Proc(k, v["pid"], v["port"], Path(v["log"])) for k, v in raw.items()}

    def _save(self, procs: dict[str, Proc]) -> None:
        self.state_file.write_text(
            json.dumps({k: {"pid": p.pid, "port": p.port, "log": str(p.log)} for k, p in procs.items()})
        )

    def _record(self, p: Proc) -> None:
        procs = self.procs()
        procs[p.name] = p
        self._save(procs)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], port: int, cpus: set[int] | None = None) -> Proc:
        log = self.logs / f"{name}.log"
        # Pinned before exec, so every thread and child process (vLLM's) inherits the set.
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(log, "ab") as f:
            popen = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=pin
            )
        p = Proc(name, popen.pid, port, log)
        self._record(p)
        return p

    # -- redis ------------------------------------------------------------------------
    def start_redis(self, port: int = 0) -> str:
        """An embedded redis-server: AOF on, noeviction, data in <run_dir>/redis."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: install it (apt-get install redis-server) or set REDIS_URL")
        port = port or free_port()
        data = self.run_dir / "redis"
        data.mkdir(exist_ok=True)
        cmd = [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
            "--save",
            "",
            "--daemonize",
            "no",
        ]
        self._spawn("redis", cmd, dict(os.environ), port)
        deadline = time.time() + 15
        while not port_open(port):
            if time.time() > deadline:
                raise RuntimeError(f"redis-server did not start; see {self.logs / 'redis.log'}")
            time.sleep(0.1)
        return f"redis://127.0.0.1:{port}/0"

    # -- services ---------------------------------------------------------------------
    def start_service(
        self, role: str, env: dict[str, str], *, name: str | None = None, port: int = 0, cpus: set[int] | None = None
    ) -> Proc:
        """Start `python -m services.<role>`; `cpus` pins it (and its children) to those cores."""
        port = port or DEFAULT_PORTS[role]
        full = {**os.environ, **env, "BURSTRL_PORT": str(port), "PYTHONUNBUFFERED": "1"}
        return self._spawn(name or role, [sys.executable, "-m", f"services.{role}"], full, port, cpus)

    def wait_ready(self, names: list[str], timeout: float = 300.0, on_wait=None) -> None:  # noqa: ANN001
        procs = self.procs()
        deadline = time.time() + timeout
        pending = set(names)
        while pending:
            for n in list(pending):
                p = procs[n]
                if not alive(p.pid):
                    raise RuntimeError(f"{n} exited during start-up; last lines of {p.log}:\n{tail(p.log)}")
                try:
                    if httpx.get(f"http://127.0.0.1:{p.port}/readyz", timeout=2).status_code == 200:
                        pending.discard(n)
                except httpx.HTTPError:
                    pass
            if pending and time.time() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f}s: {sorted(pending)}")
            if pending:
                if on_wait:
                    on_wait(sorted(pending))
                time.sleep(0.5)

    def stop(self, name: str, timeout: float = 20.0) -> None:
        procs = self.procs()
        p = procs.pop(name, None)
        if p is None:
            return
        terminate(p.pid, timeout)
        self._save(procs)

    def stop_all(self) -> None:
        # Services first, Redis last, so services can finish their last writes.
        for name in sorted(self.procs(), key=lambda n: n == "redis"):
            self.stop(name)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as dead
        wpid, _ = os.waitpid(pid, os.WNOHANG)
        return wpid == 0
    except ChildProcessError:
        return True


def terminate(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM the process group we started, then SIGKILL it after `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            if not alive(pid):
                return
            time.sleep(0.1)


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"
