"""check_isolation(): whether the sandbox works on this host, and if not, what is missing.

The single source of truth for "can code run here": the reward service reports it at
start (readiness info, a gauge), the code verifier and the tool route refuse without it,
and docs/sandbox.md lists the same requirements for operators. It runs the real path
(preflight, then one sandboxed probe) and checks each property from the inside.
"""

from __future__ import annotations

import threading
from pathlib import Path

from shared.domain.sandbox.errors import SandboxUnavailable
from shared.domain.sandbox.limits import Limits, settings
from shared.domain.sandbox.report import read_report
from shared.domain.sandbox.run import spawn
from shared.domain.sandbox.verdict import program_result

PROBE_LIMITS = Limits(cpu_s=5, wall_s=30.0, nproc=32)
HOST_MARKER = str(Path(__file__).resolve().parent)  # exists on the host; must not inside
PROBE = f"""\
import ctypes, os, resource, socket
libc = ctypes.CDLL(None, use_errno=True)
def check(name, fn):
    try:
        print(name, bool(fn()))
    except OSError:
        print(name, False)
def connects():
    s = socket.socket(); s.settimeout(0.5); s.connect(("1.1.1.1", 53)); return True
def writes_root():
    open("/burstrl-probe", "w"); return True
def netlink():
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12); return True
check("network", connects)
check("writable_root", writes_root)
check("host_files", lambda: os.path.exists({HOST_MARKER!r}))
check("host_proc", lambda: os.readlink("/proc/self") != str(os.getpid()))
check("nested_namespaces", lambda: libc.unshare(0x10000000) == 0)
check("netlink", netlink)
check("nproc_unlimited", lambda: resource.getrlimit(resource.RLIMIT_NPROC)[0] != {PROBE_LIMITS.nproc})
"""
# What each probe line means when it says True.
FAILURES = {
    "network": "the sandbox reaches the network",
    "writable_root": "the sandbox's root is writable",
    "host_files": "the host's files are visible in the sandbox",
    "host_proc": "the sandbox sees the host's /proc",
    "nested_namespaces": "the sandbox can create namespaces (seccomp filter not in force)",
    "netlink": "the sandbox can open netlink sockets (seccomp filter not in force)",
    "nproc_unlimited": "the process limit is not in force inside the sandbox",
}

_checked: tuple[bool, str] | None = None
_check_lock = threading.Lock()


def _probe() -> tuple[bool, str]:
    try:
        rep = read_report(*spawn(PROBE, [{"stdin": ""}], PROBE_LIMITS), 1, PROBE_LIMITS.max_report)
    except SandboxUnavailable as e:
        return False, str(e)
    res = program_result(rep)
    if res.reason != "ok":
        return False, f"isolation probe failed: {res.reason} {res.detail}".strip()
    seen = dict(ln.split(" ", 1) for ln in res.stdout.splitlines() if " " in ln)
    missing = [k for k in FAILURES if k not in seen]
    if missing:
        return False, f"isolation probe incomplete: no answer for {missing}"
    broken = [FAILURES[k] for k in FAILURES if seen[k] != "False"]
    if broken:
        return False, "isolation probe failed: " + "; ".join(broken)
    proc = "private /proc" if settings().proc == "private" else "no /proc (BURSTRL_SANDBOX_PROC=off)"
    return True, f"namespaces ok: minimal root, {proc}, no network, seccomp, per-run process limit"


def check_isolation() -> tuple[bool, str]:
    """(True, summary) when the sandbox isolates here, else (False, what is missing). Cached."""
    global _checked
    with _check_lock:
        if _checked is None:
            _checked = _probe()
        return _checked
