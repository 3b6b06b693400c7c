"""Run untrusted Python (model-written code) against test cases, isolated.

Why in shared/domain: the reward service scores code tasks with it, and rollout's held-out
evaluation scores the same tasks; it needs no torch (pyseccomp and the system's
libseccomp for its filter), so shared stays light.

Isolation, per run (Linux namespaces through util-linux `unshare`, no setuid helper):
- new user, mount, pid, network (no interfaces but a down loopback), ipc, uts and cgroup
  namespaces; as root, also a uid nothing else uses (a pool of uids with file locks);
- a minimal root (root.py): an empty tmpfs holding only the interpreter, its stdlib and
  the libraries they load, bound read-only, a few device nodes, a /proc of its own pid
  namespace and a private size-capped /tmp (its working directory). No dataset, model
  cache, home folder or database socket of the host is there to be found;
- rlimits on CPU time, address space, processes, open files, file size, no core dumps,
  set inside the user namespace (the process limit then counts this run's processes
  only, so concurrent runs and the service's own threads never eat into it);
- every capability dropped, no_new_privs, and a seccomp filter (seccomp.py) denying new
  namespaces, keyrings, bpf, ptrace, perf, mounts, netlink and packet sockets;
- the solution never holds the report channel (_harness.py): each test runs in a child
  that can only write its own result, which is parsed with bounded size and depth;
- a wall-clock deadline after which the namespace's init is SIGKILLed, taking every
  descendant with it.

The verdict (verdict.py) is computed here, outside, by comparing what the solution printed
or returned with expected values that never enter the sandbox; its exit code is ignored.
`run_program` is the tool-call flavour (the "python" environment, through the reward
service's /v1/sandbox/run): one run on one stdin, returning what it printed and why it
ended, through the same isolation.

Where isolation is unavailable (no `unshare`, user namespaces disabled, a /proc that
cannot be mounted, no libseccomp, no interpreter the sandbox's uid can run) `run_code`
and `run_program` raise `SandboxUnavailable` saying what to fix, and `check_isolation()`
reports the same: there is no unsandboxed fallback. docs/sandbox.md lists what a host
or container must allow.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shared.domain.sandbox import limits
from shared.domain.sandbox.errors import SandboxUnavailable
from shared.domain.sandbox.isolation import check_isolation
from shared.domain.sandbox.limits import Limits, SandboxSettings, settings
from shared.domain.sandbox.report import read_report
from shared.domain.sandbox.run import HARNESS_PATH, spawn
from shared.domain.sandbox.verdict import ProgramResult, RunResult, TestResult, judge, program_result

log = logging.getLogger(__name__)

__all__ = [
    "HARNESS_PATH",
    "Limits",
    "ProgramResult",
    "RunResult",
    "SandboxSettings",
    "SandboxUnavailable",
    "TestResult",
    "check_isolation",
    "limits",
    "run_code",
    "run_program",
    "settings",
]


def run_code(code: str, tests: list[dict[str, Any]], limits: Limits | None = None) -> RunResult:
    """Run `code` on each test and judge it.

    A test is {"stdin": str, "stdout": str} (a program) or {"call": name, "args": [...],
    "expected": value} (a function). Raises SandboxUnavailable; never runs unisolated, and
    never raises for anything the code does.
    """
    lim = limits or Limits()
    t0 = time.monotonic()
    # Only what the solution needs crosses in: never the expected outputs.
    visible: list[dict[str, Any]] = [{k: t[k] for k in ("stdin", "call", "args") if k in t} for t in tests]
    ran = spawn(code, visible, lim)
    try:
        res = judge(tests, read_report(*ran, len(tests), lim.max_report), lim.max_output)
    except SandboxUnavailable:
        raise
    except Exception as e:  # noqa: BLE001  (a verdict not reached scores this solution alone, never its group)
        log.warning("judging a run failed, scored 0 (judge_error): %s: %s", type(e).__name__, str(e)[:200])
        res = RunResult([TestResult(False, "judge_error") for _ in tests], "judge_error", type(e).__name__)
    res.seconds = time.monotonic() - t0
    return res


def run_program(code: str, stdin: str = "", limits: Limits | None = None) -> ProgramResult:
    """Run `code` once as a program on `stdin` and return what it printed (a tool call).

    Same isolation as run_code; there is nothing to judge, so the reason only says how
    the run ended. stdout is what the program printed before it ended (capped at
    limits.max_output characters). Raises SandboxUnavailable; never runs unisolated.
    """
    lim = limits or Limits()
    t0 = time.monotonic()
    res = program_result(read_report(*spawn(code, [{"stdin": stdin}], lim), 1, lim.max_report))
    res.seconds = time.monotonic() - t0
    return res
