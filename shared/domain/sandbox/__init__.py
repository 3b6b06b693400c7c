"""Run untrusted Python (model-written code) against test cases, isolated.

Why in shared/: the reward service scores code tasks with it, and rollout's held-out
evaluation scores the same tasks; it is stdlib-only, so shared stays light.

Isolation, per run (Linux namespaces through util-linux `unshare`, no setuid helper):
- a process of its own, started as a uid nothing else uses (a pool of uids with file
  locks, so concurrent runs, worker processes and replicas never share one). RLIMIT_NPROC
  counts per uid: a fork bomb hits its own 32-process wall and nobody else's;
- new user, network (no interfaces but a down loopback), pid, mount, ipc and uts
  namespaces. Inside, every mount is remounted read-only, /tmp is a private size-capped
  tmpfs (its working directory), /proc shows only its own pid namespace, and every
  capability is dropped with no_new_privs set;
- rlimits on CPU time, address space, processes, open files, file size, no core dumps;
  a wall-clock deadline after which the whole process group is SIGKILLed; since the
  supervisor is pid 1 of the namespace, its death takes every descendant with it;
- stdout capped in the solution's process and again on the pipe.

The verdict is computed here, outside, by comparing what the solution printed or
returned with expected values that never enter the sandbox; its exit code is ignored.
`run_program` is the tool-call flavour (the "python" environment, through the reward
service's /v1/sandbox/run): one run on one stdin, returning what it printed and why it
ended, through the same isolation.

Where isolation is unavailable (no `unshare`, user namespaces disabled, no usable
Python for the sandbox uid) `run_code` and `run_program` raise `SandboxUnavailable` saying what to fix:
there is no unsandboxed fallback.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

HARNESS_PATH = Path(__file__).with_name("_harness.py")
_HARNESS_SRC = HARNESS_PATH.read_text()


class SandboxUnavailable(RuntimeError):
    """Isolation can't be set up here; code rewards must not run."""


class SandboxSettings(BaseSettings):
    """`BURSTRL_SANDBOX_*`: where the sandbox finds its interpreter and its uids."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_SANDBOX_", extra="ignore")

    python: str = Field(
        "/usr/bin/python3",
        description="Interpreter run inside the sandbox; must be readable and executable by an unprivileged "
        "uid (a pyenv under /root is not).",
    )
    uid_base: int = Field(2_100_000_000, ge=1000, description="First uid of the pool (when the service runs as root).")
    uid_count: int = Field(64, ge=1, le=4096, description="Pool size = most concurrent runs on this machine.")
    lock_dir: Path = Field(
        Path(tempfile.gettempdir()) / f"burstrl-sandbox-{os.geteuid()}",
        description="Where uid-slot locks live (shared by every process on the machine).",
    )


@dataclass(frozen=True)
class Limits:
    """Per-run limits. CPU applies per process; wall to the whole run."""

    cpu_s: int = 2
    wall_s: float = 6.0
    memory_mb: int = 256
    nproc: int = 32
    nofile: int = 64
    fsize_mb: int = 4
    tmpfs_mb: int = 16
    max_output: int = 1 << 20  # characters of stdout kept per test
    max_report: int = 4 << 20  # bytes of the whole report

    @classmethod
    def for_program(cls, timeout_s: float, max_output: int, memory_mb: int = 256) -> Limits:
        """One tool-style program run: `timeout_s` of wall clock (and as much CPU, whole
        seconds), `max_output` characters of stdout, room in the report for them."""
        return cls(
            cpu_s=max(1, math.ceil(timeout_s)),
            wall_s=timeout_s,
            memory_mb=memory_mb,
            max_output=max_output,
            # The report carries the output JSON-escaped (up to 6 bytes per character) plus framing.
            max_report=max(cls.max_report, 6 * max_output + 4096),
        )


@dataclass
class TestResult:
    passed: bool
    reason: str  # "ok", "wrong_answer", "runtime_error:ValueError", ...


@dataclass
class RunResult:
    """What happened to one solution: per-test verdicts and one headline reason."""

    tests: list[TestResult] = field(default_factory=list)
    reason: str = "ok"
    detail: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.tests) if self.tests else 0.0


# -- uid slots -------------------------------------------------------------------------
_settings: SandboxSettings | None = None


def settings() -> SandboxSettings:
    global _settings
    if _settings is None:
        _settings = SandboxSettings()
    return _settings


@contextmanager
def _uid_slot(s: SandboxSettings) -> Iterator[int | None]:
    """Hold an exclusive uid from the pool (None when not root: the run keeps our uid)."""
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


# -- running ---------------------------------------------------------------------------
def _command(s: SandboxSettings, lim: Limits) -> list[str]:
    unshare, prlimit = shutil.which("unshare"), shutil.which("prlimit")
    if not unshare or not prlimit:
        raise SandboxUnavailable(
            "code rewards need util-linux `unshare` and `prlimit` on PATH (apt-get install util-linux)"
        )
    mem = lim.memory_mb << 20
    return [
        prlimit,
        f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}",  # soft first: SIGXCPU names the reason before the hard SIGKILL
        f"--as={mem}:{mem}",
        f"--nproc={lim.nproc}:{lim.nproc}",
        f"--nofile={lim.nofile}:{lim.nofile}",
        f"--fsize={lim.fsize_mb << 20}:{lim.fsize_mb << 20}",
        "--core=0:0",
        "--",
        unshare,
        "--user",
        "--map-root-user",
        "--mount",
        "--net",
        "--pid",
        "--fork",
        "--kill-child",
        "--ipc",
        "--uts",
        "--",
        s.python,
        "-I",  # isolated: no env vars, no user site, no cwd on sys.path
        "-S",  # no site: faster start, nothing from site-packages
        "-c",
        _HARNESS_SRC,
    ]


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the namespace's init, then wait for `unshare` to reap it.

    The kernel only lets init finish dying once every process of its pid namespace is
    gone, and `unshare` only exits after that: so when this returns, nothing of the run
    is left (not even a child that called setsid). Killing the process group first
    would let `unshare` die early and leave the teardown racing the next run.
    """
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _spawn(code: str, tests: list[dict[str, Any]], lim: Limits) -> tuple[bytes, bytes, int | None, bool]:
    """Run the harness on `tests` (only what may cross in) under full isolation.

    Returns the harness's stdout, its stderr, the exit status and whether the wall-clock
    deadline killed it. Raises SandboxUnavailable; never runs unisolated. Every entry
    point (run_code, run_program) goes through here, so they share one isolation path.
    """
    s = settings()
    payload = json.dumps(
        {
            "code": code,
            "tests": tests,
            "tmpfs_mb": lim.tmpfs_mb,
            "max_output": lim.max_output,
            "max_report": lim.max_report,
        }
    )
    with _uid_slot(s) as uid:
        ids: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        try:
            proc = subprocess.Popen(
                _command(s, lim),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,  # its own process group: one killpg ends it all
                **ids,
            )
        except OSError as e:
            raise SandboxUnavailable(f"could not start the sandbox: {e}") from e
        try:
            out, err = proc.communicate(payload.encode(), timeout=lim.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_run(proc)
            out, err = proc.communicate()
            timed_out = True
        finally:
            if proc.poll() is None:
                _kill_run(proc)
    return out, err, proc.returncode, timed_out


def run_code(code: str, tests: list[dict[str, Any]], limits: Limits | None = None) -> RunResult:
    """Run `code` on each test and judge it.

    A test is {"stdin": str, "stdout": str} (a program) or {"call": name, "args": [...],
    "expected": value} (a function). Raises SandboxUnavailable; never runs unisolated.
    """
    lim = limits or Limits()
    t0 = time.monotonic()
    # Only what the solution needs crosses in: never the expected outputs.
    visible = [{k: t[k] for k in ("stdin", "call", "args") if k in t} for t in tests]
    res = _judge(tests, _read_report(*_spawn(code, visible, lim)))
    res.seconds = time.monotonic() - t0
    return res


@dataclass
class ProgramResult:
    """What one program run printed, and why it ended (RunResult's reason vocabulary)."""

    stdout: str = ""
    reason: str = "ok"  # "ok", "runtime_error:Kind", "wall_time_limit", "output_limit", "syntax_error", ...
    detail: str = ""  # e.g. "ZeroDivisionError: division by zero" (the traceback's last line)
    seconds: float = 0.0


def run_program(code: str, stdin: str = "", limits: Limits | None = None) -> ProgramResult:
    """Run `code` once as a program on `stdin` and return what it printed (a tool call).

    Same isolation as run_code; there is nothing to judge, so the reason only says how
    the run ended. stdout is what the program printed before it ended (capped at
    limits.max_output characters). Raises SandboxUnavailable; never runs unisolated.
    """
    lim = limits or Limits()
    t0 = time.monotonic()
    rep = _read_report(*_spawn(code, [{"stdin": stdin}], lim))
    got = rep.tests.get(0) or {}
    res = ProgramResult(stdout=str(got.get("stdout", "")))
    headline = _headline(rep)
    if headline is not None:
        res.reason, res.detail = headline
    elif "error" in got:
        res.reason, res.detail = _error_reason(str(got["error"])), str(got["error"])
    elif got.get("exit") not in (None, "0", "None"):
        # sys.exit(<non-zero>): the program says it failed; what it printed still comes back.
        res.reason, res.detail = "runtime_error:SystemExit", f"exit status {got['exit']}"
    res.seconds = time.monotonic() - t0
    return res


_SIGNAL_REASONS = {
    signal.SIGXCPU: "cpu_time_limit",
    signal.SIGKILL: "killed",
    signal.SIGXFSZ: "file_size_limit",
    signal.SIGSEGV: "crashed",
}


@dataclass
class _Report:
    """The harness's report, parsed; `failure` is set when there is no usable report."""

    failure: tuple[str, str] | None = None  # (reason, detail): wall_time_limit, sandbox_error, ...
    tests: dict[int, dict[str, Any]] = field(default_factory=dict)  # what each test printed/returned
    fatal: str | None = None  # the code did not compile
    overflow: bool = False
    done: bool = False  # the worker reported every test
    exit_code: int = 0


def _read_report(out: bytes, err: bytes, rc: int | None, timed_out: bool) -> _Report:
    if timed_out:
        return _Report(failure=("wall_time_limit", ""))
    try:
        env = json.loads(out)
    except ValueError:
        msg = err.decode(errors="replace").strip()[-300:]
        if "Operation not permitted" in msg or "unshare failed" in msg or "No such file" in msg:
            raise SandboxUnavailable(f"sandbox could not start: {msg}") from None
        return _Report(failure=("sandbox_error", msg or f"no report (exit {rc})"))
    if "setup_error" in env:
        raise SandboxUnavailable(f"sandbox setup failed inside the namespaces: {env['setup_error']}")
    lines = []
    for ln in env["report"].splitlines():
        try:
            lines.append(json.loads(ln))
        except ValueError:
            return _Report(failure=("report_corrupted", ""))
    dicts = [d for d in lines if isinstance(d, dict)]
    return _Report(
        tests={d["i"]: d for d in dicts if isinstance(d.get("i"), int)},
        fatal=next((d["fatal"] for d in dicts if "fatal" in d), None),
        overflow=bool(env.get("overflow")),
        done=any(d.get("done") is True for d in dicts),
        exit_code=env.get("exit", 0),
    )


def _headline(rep: _Report) -> tuple[str, str] | None:
    """Why the whole run failed, whatever each test did (None: look at the tests)."""
    if rep.failure is not None:
        return rep.failure
    if rep.fatal:
        return "syntax_error", rep.fatal
    if rep.overflow:
        return "output_limit", ""
    if not rep.done:
        if rep.exit_code < 0:
            return _SIGNAL_REASONS.get(-rep.exit_code, f"signal_{-rep.exit_code}"), ""
        # os._exit() or a crash of the worker before it reported every test
        return "exited_early", f"worker exit status {rep.exit_code}"
    return None


def _judge(tests: list[dict[str, Any]], rep: _Report) -> RunResult:
    if rep.failure is not None:  # no usable report: nothing ran, as far as we can tell
        return RunResult([TestResult(False, "not_run") for _ in tests], *rep.failure)
    results = [_judge_one(t, rep.tests.get(i)) for i, t in enumerate(tests)]
    headline = _headline(rep)
    if headline is not None:
        return RunResult(results, *headline)
    failed = [r.reason for r in results if not r.passed]
    return RunResult(results, "ok" if not failed else failed[0])


def _error_reason(error: str) -> str:
    # The harness reports "Kind: message"; the CappedWriter's OverflowError is the output cap.
    kind = error.split(":", 1)[0]
    return "output_limit" if kind == "OverflowError" else f"runtime_error:{kind}"


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _same(a: Any, b: Any) -> bool:
    # Exact JSON equality, except floats compare with a tolerance (1e-6 relative).
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, int | float)
            and isinstance(b, int | float)
            and not isinstance(a, bool)
            and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _judge_one(test: dict[str, Any], got: dict[str, Any] | None) -> TestResult:
    if got is None:
        return TestResult(False, "not_run")
    if "error" in got:
        return TestResult(False, _error_reason(str(got["error"])))
    if "call" in test:
        try:
            ret = json.loads(got.get("ret", "null"))
        except ValueError:
            return TestResult(False, "wrong_answer")
        # the expected value is normalised through JSON too (tuples -> lists)
        ok = _same(ret, json.loads(json.dumps(test.get("expected"))))
    else:
        ok = _normalize(str(got.get("stdout", ""))) == _normalize(str(test.get("stdout", "")))
    return TestResult(ok, "ok" if ok else "wrong_answer")


_checked: tuple[bool, str] | None = None
_check_lock = threading.Lock()


def check_isolation() -> tuple[bool, str]:
    """Whether the sandbox works here (cached): runs one probe that must not reach the network."""
    global _checked
    with _check_lock:
        if _checked is None:
            probe = (
                "import socket, os\n"
                "s = socket.socket(); s.settimeout(0.5)\n"
                "try:\n    s.connect(('1.1.1.1', 53)); print('net')\nexcept OSError:\n    print('nonet')\n"
                "try:\n    open('/etc/burstrl-probe', 'w'); print('rw')\nexcept OSError:\n    print('ro')\n"
            )
            try:
                r = run_code(probe, [{"stdin": "", "stdout": "nonet\nro"}])
                _checked = (True, "namespaces ok") if r.passed == 1 else (False, f"isolation probe failed: {r.reason}")
            except SandboxUnavailable as e:
                _checked = (False, str(e))
        return _checked
