"""`burstrl up` as a newcomer meets it: ports that can move, and a restart of one role that
leaves the others running (real processes, real HTTP, a real Redis)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from services.cli.launch import Launcher, alive, free_port
from services.cli.stack import api_url, parse_ports, stack_ports, start_stack


def test_ports_move_with_a_base_or_per_role():
    assert stack_ports(["api", "trainer"]) == {"api": 8700, "trainer": 8704}
    assert stack_ports(["api", "reward", "trainer"], base=9100) == {"api": 9100, "reward": 9102, "trainer": 9104}
    assert stack_ports(["api", "reward"], base=9100, given=parse_ports("reward=9555")) == {"api": 9100, "reward": 9555}
    with pytest.raises(ValueError, match="ROLE=PORT"):
        parse_ports("api:9000")
    with pytest.raises(ValueError, match="unknown roles"):
        stack_ports(["api", "nosuch"])
    with pytest.raises(ValueError, match="outside"):
        stack_ports(["trainer"], base=65534)


def test_up_restarts_only_the_roles_it_names(tmp_path: Path, redis_server, monkeypatch, tiny_model: Path):  # noqa: ANN001
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    monkeypatch.delenv("BURSTRL_TOKEN", raising=False)
    home = tmp_path / "home"
    launcher = Launcher(home / "run")
    try:
        # A port someone else holds: a clear refusal that says how to move the stack.
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            with pytest.raises(RuntimeError, match="--port-base"):
                start_stack(home, str(tiny_model), ["api"], ports={"api": busy.getsockname()[1]}, log=lambda _: None)
        ports = {"api": free_port(), "reward": free_port()}
        start_stack(home, str(tiny_model), ["api", "reward"], ports=ports, log=lambda _: None)
        before = launcher.procs()
        assert api_url(home) == f"http://127.0.0.1:{ports['api']}"
        assert httpx.get(f"{api_url(home)}/healthz", timeout=5).status_code == 200
        start_stack(home, str(tiny_model), ["reward"], ports={"reward": ports["reward"]}, log=lambda _: None)
        after = launcher.procs()
        assert after["api"].pid == before["api"].pid and alive(after["api"].pid)  # left running
        assert after["reward"].pid != before["reward"].pid and not alive(before["reward"].pid)
        assert httpx.get(f"http://127.0.0.1:{ports['reward']}/readyz", timeout=5).status_code == 200
    finally:
        launcher.stop_all()
