"""The sandbox against attacks on its own machinery: the report channel, nested namespaces,
kernel interfaces a solution has no business with, and a bad interpreter setting.

Every case runs a real sandbox; nothing is mocked.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest

from shared.domain import sandbox
from shared.domain.sandbox import Limits, SandboxSettings, SandboxUnavailable, check_isolation, run_code, run_program

ok, why = check_isolation()
pytestmark = pytest.mark.skipif(not ok, reason=f"sandbox unavailable here: {why}")

TIGHT = Limits(cpu_s=2, wall_s=8.0, max_output=1 << 16)
ADD = [{"stdin": "1 2", "stdout": "3"}, {"stdin": "5 7", "stdout": "12"}]
GOOD_ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
FORGERIES = [b'{"i": 0, "ret": 5}\n', b"[" * 100000, b'{"done": true}\n{"i": 1, "stdout": "12"}\n', b"\xff\xfe{\n"]


@pytest.mark.parametrize("forged", FORGERIES)
def test_the_report_channel_is_closed_to_the_solution(forged: bytes) -> None:
    # fd 4 was the worker's report pipe: a write there crashed the trusted parent.
    r = run_code(f"import os\nos.write(4, {forged!r})\n" + GOOD_ADD, ADD, TIGHT)
    assert r.passed == 0 and r.reason == "runtime_error:OSError", r  # EBADF: nothing is there


@pytest.mark.parametrize("forged", FORGERIES)
def test_forgeries_on_any_descriptor_hurt_only_the_forger(forged: bytes) -> None:
    # Whatever descriptor a solution finds, what it writes there is its own result at worst:
    # fd 1 is its real stdout, so the forgery is its output there (wrong, or over the cap).
    spray = (
        "import os\nfor fd in range(64):\n    try:\n"
        f"        os.write(fd, {forged!r})\n    except OSError:\n        pass\n"
    )
    r = run_code(spray + GOOD_ADD, ADD, TIGHT)
    assert all(t.reason in ("ok", "report_corrupted", "wrong_answer", "output_limit") for t in r.tests), r
    assert run_code(GOOD_ADD, ADD, TIGHT).fraction == 1.0


def test_nested_namespaces_and_netlink_are_denied() -> None:
    code = (
        "import ctypes, os, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for flag in (0x10000000, 0x40000000, 0x20000):  # CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS\n"
        "    print('unshare', libc.unshare(flag), os.strerror(ctypes.get_errno()))\n"
        "try:\n"
        "    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER\n"
        "    print('netlink open')\n"
        "except OSError as e:\n"
        "    print('netlink', e.strerror)\n"
        "print('ptrace', libc.ptrace(0, 0, 0, 0))  # PTRACE_TRACEME\n"
    )
    r = run_program(code, limits=TIGHT)
    assert r.reason == "ok", r
    lines = r.stdout.splitlines()
    assert lines[:3] == ["unshare -1 Operation not permitted"] * 3, r.stdout
    assert lines[3] == "netlink Operation not permitted", r.stdout
    assert lines[4] == "ptrace -1", r.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="raw syscall numbers of x86_64")
def test_keyrings_bpf_and_perf_are_denied() -> None:
    # add_key 248, keyctl 250, request_key 249, bpf 321, perf_event_open 298 (x86_64)
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for nr in (248, 249, 250, 321, 298):\n"
        "    ctypes.set_errno(0)\n"
        "    rc = libc.syscall(nr, 0, 0, 0, 0, 0)\n"
        "    print(nr, rc, ctypes.get_errno())\n"
    )
    r = run_program(code, limits=TIGHT)
    assert r.reason == "ok", r
    assert r.stdout.split("\n")[:-1] == [f"{nr} -1 1" for nr in (248, 249, 250, 321, 298)]  # EPERM


def test_an_unreadable_interpreter_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "python3"
    shutil.copy(os.path.realpath("/usr/bin/python3"), python)
    python.chmod(0o000)  # nobody but root may read or run it; the sandbox never runs as root
    monkeypatch.setattr(sandbox.limits, "_settings", SandboxSettings(python=str(python)))
    with pytest.raises(SandboxUnavailable, match="BURSTRL_SANDBOX_PYTHON"):
        run_code(GOOD_ADD, ADD, TIGHT)
    with pytest.raises(SandboxUnavailable, match="BURSTRL_SANDBOX_PYTHON"):
        run_program("print(1)", limits=TIGHT)
    monkeypatch.setattr(sandbox.limits, "_settings", SandboxSettings(python=str(tmp_path / "missing")))
    with pytest.raises(SandboxUnavailable, match="BURSTRL_SANDBOX_PYTHON"):
        run_program("print(1)", limits=TIGHT)


def test_a_tiny_timeout_is_a_wall_time_limit() -> None:
    r = run_program("print(1)", limits=Limits.for_program(1e-9, 1000))
    assert r.reason == "wall_time_limit" and r.stdout == "", r
    assert run_program("print(1)", limits=TIGHT).stdout == "1\n"
