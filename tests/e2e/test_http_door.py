"""Issue 47 item 3: servers that hold their doors. The api and the reward service as real
processes (started the way `burstrl up` starts them, beside the test's redis-server), talked to
over raw sockets where a well-behaved client would not do what an attacker does.

The services start with the common soft open-file limit of 1,024 (as on most hosts); each raises
it to the hard limit at start. Memory is the service process's own RSS and peak (/proc).
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli.launch import free_port
from tests.support.launched import service_launcher

TOKEN = "door-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MIB = 1 << 20
HEAD_TIMEOUT_S = 6.0
BODY_TIMEOUT_S = 3.0
IDLE = 1100


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


class Served:
    def __init__(self, pid: int, port: int, log: Path) -> None:
        self.pid, self.port, self.log = pid, port, log
        self.url = f"http://127.0.0.1:{port}"

    def rss_mb(self) -> float:
        return _status_kb(self.pid, "VmRSS") / 1024

    def peak_mb(self) -> float:
        return _status_kb(self.pid, "VmHWM") / 1024

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)


@pytest.fixture
def services(r, redis_server, tmp_path) -> Iterator[dict[str, Served]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE + 512:
        pytest.skip(f"the hard open-file limit ({hard}) is below what this test opens")
    # The services inherit the common soft limit; this process keeps room for its own sockets.
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    ports = {"api": free_port(), "reward": free_port()}
    env = {"BURSTRL_HTTP_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S), "BURSTRL_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}
    try:
        with service_launcher(tmp_path / "home", redis_server.url, TOKEN, **env) as (launcher, full_env):
            procs = {role: launcher.start_service(role, full_env, port=port) for role, port in ports.items()}
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            launcher.wait_ready(list(procs), timeout=120)
            yield {role: Served(p.pid, p.port, p.log) for role, p in procs.items()}
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    """Whether the server closes the connection within `within_s` (what it still sends is read and
    dropped: the rest of an answer may come after its head)."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(65536) == b"":
                return True
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _response_status(s: socket.socket) -> int:
    head = b""
    while b"\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            raise AssertionError(f"connection closed before a status line ({head!r})")
        head += chunk
    return int(head.split(b" ", 2)[1])


def test_1100_idle_connections_leave_normal_requests_served(services, capsys):
    api = services["api"]
    limit = int(
        next(line for line in Path(f"/proc/{api.pid}/limits").read_text().splitlines() if "open files" in line).split()[
            3
        ]
    )
    assert limit > IDLE + 100, f"the api kept a soft open-file limit of {limit}"
    assert "open files: soft limit" in api.log.read_text()
    idle = [api.connect() for _ in range(IDLE)]  # half-open: connected, nothing sent
    try:
        took = []
        with httpx.Client(base_url=api.url, headers=AUTH, timeout=60) as c:
            for i in range(20):
                t0 = time.monotonic()
                resp = c.get("/v1/jobs") if i % 2 else c.post("/v1/jobs", json={"base_model": "m", "eval_size": 0})
                took.append(time.monotonic() - t0)
                assert resp.status_code in (200, 201), resp.text
            assert c.get("/readyz").status_code == 200  # the feeder kept running: no EMFILE
        with capsys.disabled():
            print(f"\n[door] {IDLE} idle connections held: 20 requests, slowest {max(took):.3f} s")
        # The head deadline reaps them: none outlives it by much.
        deadline = time.monotonic() + HEAD_TIMEOUT_S + 30
        for s in idle:
            assert _closed_by_server(s, max(0.1, deadline - time.monotonic())), (
                "an idle connection outlived the head deadline"
            )
    finally:
        for s in idle:
            s.close()
    assert "EMFILE" not in api.log.read_text() and "Too many open files" not in api.log.read_text()


def test_a_slow_header_is_cut_off_at_the_head_deadline(services):
    api = services["api"]
    s = api.connect()
    t0 = time.monotonic()
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    closed = False
    try:
        while time.monotonic() - t0 < HEAD_TIMEOUT_S + 30:
            s.sendall(b"X-Drip: 1\r\n")  # a header line a second: bytes keep coming, the head never ends
            if _closed_by_server(s, 1.0):
                closed = True
                break
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    finally:
        s.close()
    assert closed, "a header dripped a line a second was never cut off"
    assert time.monotonic() - t0 >= HEAD_TIMEOUT_S - 0.5
    assert httpx.get(f"{api.url}/healthz", timeout=10).status_code == 200


def test_a_head_over_the_limit_is_a_431_and_a_100_mib_one_costs_no_memory(services, capsys):
    api = services["api"]
    s = api.connect()
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (80 * 1024))
    assert _response_status(s) == 431
    s.close()

    httpx.get(f"{api.url}/healthz", timeout=10)
    rss, peak = api.rss_mb(), api.peak_mb()
    s = api.connect()
    sent = 0
    try:
        s.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk = b"a" * MIB
        while sent < 100 * MIB:
            s.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused (431) and closed after the first 64 KiB: the rest is never read
    finally:
        s.close()
    time.sleep(0.5)
    grew, peak_grew = api.rss_mb() - rss, api.peak_mb() - peak
    with capsys.disabled():
        print(f"\n[door] 100 MiB header: {sent / MIB:.0f} MiB sent, api RSS +{grew:.1f} MB, peak +{peak_grew:.1f} MB")
    assert grew <= 10 and peak_grew <= 10
    assert httpx.get(f"{api.url}/healthz", timeout=10).status_code == 200


def _unauthenticated_body(served: Served, path: str, size: int) -> int:
    """POST `size` bytes to `path` without a token, the way a client that writes first does."""
    s = served.connect()
    try:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode()
        )
        chunk = b"{" + b" " * (MIB - 1)
        left = size
        while left:
            n = min(left, len(chunk))
            s.sendall(chunk[:n])
            left -= n
        return _response_status(s)
    finally:
        s.close()


@pytest.mark.parametrize(("role", "path"), [("reward", "/v1/sandbox/run"), ("api", "/v1/jobs")])
def test_an_unauthenticated_200_mib_body_is_refused_unread(services, role, path, capsys):
    served = services[role]
    httpx.get(f"{served.url}/healthz", timeout=10)
    rss, peak = served.rss_mb(), served.peak_mb()
    status = _unauthenticated_body(served, path, 200 * MIB)
    time.sleep(0.5)
    grew, peak_grew = served.rss_mb() - rss, served.peak_mb() - peak
    with capsys.disabled():
        print(
            f"\n[door] {role}: unauthenticated 200 MiB body -> {status}, RSS +{grew:.1f} MB, peak +{peak_grew:.1f} MB"
        )
    assert status == 401
    assert grew <= 10 and peak_grew <= 10
    assert httpx.get(f"{served.url}/healthz", timeout=10).status_code == 200


def test_a_slow_body_times_out_with_a_408(services):
    api = services["api"]
    s = api.connect()
    try:
        s.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
            + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
            + b'{"base_model": "m", '
        )
        stop = threading.Event()

        def drip() -> None:  # a byte a second: never the whole body
            while not stop.wait(1.0):
                try:
                    s.sendall(b" ")
                except OSError:
                    return

        t = threading.Thread(target=drip, daemon=True)
        t.start()
        t0 = time.monotonic()
        status = _response_status(s)
        waited = time.monotonic() - t0
        stop.set()
        assert status == 408 and waited >= BODY_TIMEOUT_S - 0.5
        assert _closed_by_server(s, HEAD_TIMEOUT_S + 10)  # and it does not read on
    finally:
        s.close()
    assert httpx.get(f"{api.url}/healthz", timeout=10).status_code == 200
