"""Running compose projects on podman for the container tests (tests/e2e/test_containers.py).

- `Engine`: podman's Docker-compatible API on a socket of our own (`podman system service`), and
  docker/local/healthd.py driving the healthchecks (podman's timers need systemd, absent here);
  both are processes we start and stop by pid.
- `Project`: one compose project (files, project name, environment), run through the `docker
  compose` CLI exactly as a person types it; waits on container health; `down -v` of its own name.
Everything a test creates carries its project's name, so cleanup never touches anything else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
HEALTHD = ROOT / "docker" / "local" / "healthd.py"


def compose_cli() -> list[str] | None:
    """`docker compose` (v2, the README's spelling), else the standalone v2 binary, else None."""
    for cli in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cli[0]):
            out = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2"):
                return cli
    return None


def missing_tools() -> str | None:
    """Why the container tests cannot run here (None when they can)."""
    if not shutil.which("podman"):
        return "podman is not installed (make install-containers)"
    if compose_cli() is None:
        return "Compose v2 is not installed (make install-containers)"
    for image in (
        "localhost/burstrl/api:0.1.0",
        "localhost/burstrl/laptop:0.1.0",
        "localhost/burstrl-local/s3:bookworm",
    ):
        if subprocess.run(["podman", "image", "exists", image]).returncode != 0:
            return f"{image} is not built (make images)"
    return None


class Engine:
    """podman's Docker API on tmp/podman.sock, and the healthcheck driver for `projects`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.sock = tmp / "podman.sock"
        self.procs: list[subprocess.Popen] = []
        self.healthd: subprocess.Popen | None = None

    @property
    def docker_host(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> None:
        log = (self.tmp / "podman-service.log").open("w")
        self.procs.append(
            subprocess.Popen(
                ["podman", "system", "service", "--time=0", self.docker_host],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        wait_for(self.sock.exists, 30, "podman's API socket")

    def watch_health(self, projects: Sequence[str]) -> None:
        """(Re)start healthd for these compose projects."""
        if self.healthd is not None:
            _stop(self.healthd)
        log = (self.tmp / "healthd.log").open("a")
        self.healthd = subprocess.Popen(
            [sys.executable, str(HEALTHD), *projects], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self) -> None:
        for p in [self.healthd, *self.procs]:
            if p is not None:
                _stop(p)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class Project:
    """A compose project: `files` (relative to compose/ or absolute), its name, its environment."""

    def __init__(self, engine: Engine, name: str, files: Sequence[str | Path], env: dict[str, str]) -> None:
        self.engine, self.name = engine, name
        self.cli = compose_cli() or ["docker", "compose"]
        paths = [Path(f) if Path(f).is_absolute() else COMPOSE_DIR / f for f in files]
        # COMPOSE_FILE and COMPOSE_PROJECT_NAME instead of -f/-p: the commands stay as written.
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("BURSTRL_", "COMPOSE_", "DOCKER_"))},
            **env,
            "COMPOSE_FILE": os.pathsep.join(str(p) for p in paths),
            "COMPOSE_PROJECT_NAME": name,
            "DOCKER_HOST": engine.docker_host,
        }
        self.cwd = paths[0].parent
        self.attached: list[subprocess.Popen] = []

    def run(self, *args: str, check: bool = True, timeout: float = 600, env: dict[str, str] | None = None):
        """`docker compose ARGS`, waited for; CompletedProcess (stdout and stderr as text)."""
        out = subprocess.run(
            [*self.cli, *args],
            cwd=self.cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {out.returncode}:\n{out.stderr[-4000:]}")
        return out

    def run_once(self, service: str, *, timeout: float = 600, env: dict[str, str] | None = None):
        """`docker compose run -T SERVICE`: its exit status and output; then its container is removed.
        Not `run --rm`: against podman 4.3's Docker API, compose then reports exit status 0 and no
        output whatever the command did (the container is gone before compose asks how it ended)."""
        try:
            return self.run("run", "-T", service, check=False, timeout=timeout, env=env)
        finally:
            fmt = '{{.ID}} {{index .Labels "com.docker.compose.oneoff"}}'
            ls = ["podman", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.name}", "--format", fmt]
            rows = subprocess.run(ls, capture_output=True, text=True).stdout.splitlines()
            left = [r.split()[0] for r in rows if r.endswith(" True")]
            if left:
                subprocess.run(["podman", "rm", "-f", *left], capture_output=True)

    def foreground(self, *args: str) -> subprocess.Popen:
        """`docker compose ARGS` left running in the foreground, as a person runs `up`; output to a log."""
        log = (self.engine.tmp / f"{self.name}-fg-{len(self.attached)}.log").open("w")
        p = subprocess.Popen(
            [*self.cli, *args],
            cwd=self.cwd,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.attached.append(p)
        return p

    def containers(self) -> list[dict[str, Any]]:
        out = self.run("ps", "-a", "--format", "json").stdout.strip()
        if not out:
            return []
        # Compose 2.21+ prints one JSON object per line; older ones a JSON array.
        return json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines()]

    def container(self, service: str) -> dict[str, Any]:
        found = [c for c in self.containers() if c["Service"] == service]
        assert found, f"{self.name}: no container for {service}"
        return found[0]

    def inspect(self, service: str) -> dict[str, Any]:
        cid = self.container(service)["ID"]
        return json.loads(subprocess.run(["podman", "inspect", cid], capture_output=True, text=True).stdout)[0]

    def health(self) -> dict[str, str]:
        """service -> healthy / unhealthy / starting / exited(N) / running (no healthcheck)."""
        out = {}
        for c in self.containers():
            state = c.get("State", "")
            if state != "running":
                out[c["Service"]] = f"{state}({c.get('ExitCode', '?')})"
            else:
                out[c["Service"]] = c.get("Health") or "running"
        return out

    def wait_healthy(self, services: Sequence[str], timeout: float) -> dict[str, str]:
        def ok() -> dict[str, str] | None:
            h = self.health()
            # Exited: fail now, with logs. Unhealthy is not final (a slow start on a busy machine can
            # outlast its start period; the next passing check makes it healthy, as under Docker).
            bad = [s for s in services if s in h and h[s].startswith("exited")]
            assert not bad, f"{self.name}: {bad} failed: {h}\n{self.logs(*bad)}"
            return h if all(h.get(s) == "healthy" for s in services) else None

        try:
            return wait_for(ok, timeout, f"{self.name}: {list(services)} healthy")
        except TimeoutError as e:
            raise AssertionError(f"{e}: {self.health()}\n{self.logs(*services)}") from None

    def logs(self, *services: str, tail: int = 40) -> str:
        out = self.run("logs", "--no-color", "--tail", str(tail), *services, check=False)
        return out.stdout[-8000:] + out.stderr[-2000:]

    def engine_logs(self, service: str) -> str:
        """The service container's whole log, stdout and stderr, read from podman itself: `compose
        logs` through podman 4.3's API has been seen to drop a line (an empty one in its place)."""
        cid = self.container(service)["ID"]
        out = subprocess.run(["podman", "logs", cid], capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    def completed(self, service: str) -> bool:
        """A one-shot service ran to the end with exit status 0."""
        st = self.inspect(service)["State"]
        return not st["Running"] and st["ExitCode"] == 0 and not str(st.get("FinishedAt", "0001")).startswith("0001")

    def host_pid(self, service: str) -> int:
        """The pid, on this host, of the service container's main process (it is ours)."""
        pid = int(self.inspect(service)["State"]["Pid"])
        assert pid > 0, f"{service} is not running"
        return pid

    def restarts(self, service: str) -> int:
        return int(self.inspect(service).get("RestartCount", 0))

    def down(self, *extra: str) -> None:
        """Stop a foreground `up` first (as Ctrl-C does; it would go on starting services), then
        `down`; whatever of this project is still there after that is removed by its ids."""
        for p in self.attached:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in self.attached:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.attached.clear()
        self.run("down", "--remove-orphans", "--timeout", "30", *extra, check=False, timeout=300)
        # `down` leaves the containers of services whose profile it was not given (and then their
        # volumes and network): remove what still carries this project's label, by id.
        label = f"label=com.docker.compose.project={self.name}"
        kinds = [
            ("container", ["ps", "-aq"], ["rm", "-f", "-t", "0"]),
            ("network", ["network", "ls", "-q"], ["network", "rm", "-f"]),
        ]
        if "-v" in extra:
            kinds.insert(1, ("volume", ["volume", "ls", "-q"], ["volume", "rm", "-f"]))
        for _, ls, rm in kinds:
            left = subprocess.run(["podman", *ls, "--filter", label], capture_output=True, text=True).stdout.split()
            if left:
                subprocess.run(["podman", *rm, *left], capture_output=True)


def wait_for(fn: Callable[[], Any], timeout: float, what: str, every: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
