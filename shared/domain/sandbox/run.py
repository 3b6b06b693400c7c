"""Starting and stopping one sandboxed run: uid slots, the namespaces, the deadline.

Every entry point (run_code, run_program, the isolation probe) goes through `spawn`, so
they share one isolation path, and `preflight` is the one list of what the host must have.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared.domain.sandbox.errors import SandboxUnavailable
from shared.domain.sandbox.limits import Limits, SandboxSettings, settings
from shared.domain.sandbox.root import root_plan
from shared.domain.sandbox.seccomp import filter_bpf

HARNESS_PATH = Path(__file__).with_name("_harness.py")
_HARNESS_SRC = HARNESS_PATH.read_text()
# RLIMIT_NPROC counts per user namespace from Linux 5.14 on; before, a limit set inside
# counts every process of the service's uid, and a non-root service has only that one uid.
NPROC_PER_NAMESPACE = (5, 14)


# -- uid slots -------------------------------------------------------------------------
@contextmanager
def uid_slot(s: SandboxSettings) -> Iterator[int | None]:
    """Hold an exclusive uid from the pool (None when not root: the run keeps our uid).

    As root, each run gets a uid nothing else uses (file locks, so concurrent runs, worker
    processes and replicas never share one): the service's own files are then out of reach
    by permissions too. Without root the user namespace maps our uid, and the minimal root
    keeps the service's files out of sight instead.
    """
    if os.geteuid() != 0:
        yield None
        return
    s.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = s.lock_dir.stat()
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise SandboxUnavailable(f"{s.lock_dir} must be owned by root and not group/world-writable")
    start = (os.getpid() * 7 + threading.get_ident()) % s.uid_count  # spread first tries
    deadline = time.monotonic() + 60
    while True:
        for k in range(s.uid_count):
            slot = (start + k) % s.uid_count
            fd = os.open(s.lock_dir / f"slot-{slot}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield s.uid_base + slot
            finally:
                os.close(fd)  # releases the lock
            return
        if time.monotonic() > deadline:
            raise SandboxUnavailable(
                f"all {s.uid_count} sandbox uid slots busy for 60 s; raise BURSTRL_SANDBOX_UID_COUNT"
            )
        time.sleep(0.01)


def identity(uid: int | None) -> dict[str, Any]:
    """Popen arguments that run a process as the slot's uid (nothing when not root)."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


# -- what the host must have -----------------------------------------------------------
def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def preflight(s: SandboxSettings, uid: int | None) -> dict[str, Any]:
    """Everything a run needs from the host, checked (cached where it can be): the payload's
    fixed part. Raises SandboxUnavailable saying what is missing."""
    if not shutil.which("unshare"):
        raise SandboxUnavailable("code rewards need util-linux `unshare` on PATH (apt-get install util-linux)")
    if uid is None and _kernel() < NPROC_PER_NAMESPACE:
        raise SandboxUnavailable(
            f"without root the sandbox needs Linux {'.'.join(map(str, NPROC_PER_NAMESPACE))}+ (a process limit "
            f"per user namespace); this kernel is {os.uname().release}: run the service as root or on a newer kernel"
        )
    return {
        "root": root_plan(s.python, identity(uid)),
        "proc": s.proc == "private",
        "seccomp": base64.b64encode(filter_bpf()).decode(),
    }


# -- running ---------------------------------------------------------------------------
def _command(s: SandboxSettings) -> list[str]:
    return [
        shutil.which("unshare") or "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "--net",
        "--pid",
        "--fork",
        "--kill-child",
        "--ipc",
        "--uts",
        "--cgroup",
        "--",
        s.python,
        "-I",  # isolated: no env vars, no user site, no cwd on sys.path
        "-S",  # no site: faster start, nothing from site-packages
        "-c",
        _HARNESS_SRC,
    ]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the namespace's init, then wait for `unshare` to reap it.

    The kernel only lets init finish dying once every process of its pid namespace is
    gone, and `unshare` only exits after that: so when this returns, nothing of the run
    is left (not even a child that called setsid). Killing `unshare` instead would leave
    init to be reaped by whoever adopts it. A deadline can pass before `unshare` has forked
    init (timeout_s=1e-9): then wait for init to appear, briefly, rather than for `unshare`.
    """
    give_up = time.monotonic() + 5
    while proc.poll() is None and time.monotonic() < give_up:
        children = _children(proc.pid)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if children:
            try:
                proc.wait(timeout=max(0.0, give_up - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            break
        time.sleep(0.002)
    if proc.poll() is None:  # no init after 5 s: unshare itself is stuck
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def spawn(code: str, tests: list[dict[str, Any]], lim: Limits) -> tuple[bytes, bytes, int | None, bool]:
    """Run the harness on `tests` (only what may cross in) under full isolation.

    Returns the harness's stdout, its stderr, the exit status and whether the wall-clock
    deadline killed it. Raises SandboxUnavailable; never runs unisolated.
    """
    s = settings()
    with uid_slot(s) as uid:
        fixed = preflight(s, uid)
        payload = json.dumps(
            {
                **fixed,
                "code": code,
                "tests": tests,
                "tmpfs_mb": lim.tmpfs_mb,
                "max_output": lim.max_output,
                "max_report": lim.max_report,
                "rlimits": lim.rlimits(),
            }
        )
        try:
            proc = subprocess.Popen(
                _command(s),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,  # its own process group: one killpg ends it all
                **identity(uid),
            )
        except OSError as e:
            raise SandboxUnavailable(f"could not start the sandbox: {e}") from e
        try:
            out, err = proc.communicate(payload.encode(), timeout=lim.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_run(proc)
            out, err = proc.communicate()
            timed_out = True
        finally:
            if proc.poll() is None:
                kill_run(proc)
    return out, err, proc.returncode, timed_out
