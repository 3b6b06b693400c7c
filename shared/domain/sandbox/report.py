"""The harness's report, read defensively: bounded size, bounded depth, known fields only.

The report comes from the sandbox's worker, which never runs solution code; still,
nothing here trusts it: a record that is too long, nested, of the wrong shape or about a
test that does not exist makes this run "report_corrupted", never an exception in the
caller (and so never a zero for the other completions of a group).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from shared.domain.sandbox._harness import loads_bounded
from shared.domain.sandbox.errors import SandboxUnavailable, explain
from shared.text import valid_text

SIGNAL_REASONS: dict[int, str] = {
    signal.SIGXCPU: "cpu_time_limit",
    signal.SIGKILL: "killed",
    signal.SIGXFSZ: "file_size_limit",
    signal.SIGSEGV: "crashed",
}
# Every field a report record may have, and its type (bool is not an int here).
RECORD_FIELDS: dict[str, type] = {
    "i": int,
    "stdout": str,
    "ret": str,
    "error": str,
    "exit": str,
    "corrupted": bool,
    "output_limit": bool,
    "stop": int,
    "fatal": str,
    "done": bool,
}


@dataclass
class Report:
    """The report, parsed; `failure` is set when there is no usable report."""

    failure: tuple[str, str] | None = None  # (reason, detail): wall_time_limit, sandbox_error, ...
    tests: dict[int, dict[str, Any]] = field(default_factory=dict)  # what each test printed/returned
    fatal: str | None = None  # the code did not compile
    overflow: bool = False
    done: bool = False  # the worker reported every test
    stop: int | None = None  # exit status of the test process that ended the run (< 0: a signal)
    exit_code: int = 0  # the worker's own


def _valid(rec: Any, n_tests: int) -> bool:
    if not isinstance(rec, dict) or not rec:
        return False
    for k, v in rec.items():
        want = RECORD_FIELDS.get(k)
        if want is None or type(v) is not want:
            return False
    return "i" not in rec or 0 <= rec["i"] < n_tests


def read_report(out: bytes, err: bytes, rc: int | None, timed_out: bool, n_tests: int, max_report: int) -> Report:
    """Parse what the sandbox printed. Raises SandboxUnavailable only for setup failures."""
    if timed_out:
        return Report(failure=("wall_time_limit", ""))
    try:
        # The envelope is flat: {"report": "...", "overflow": bool, "exit": int}.
        env = loads_bounded(out.decode(errors="replace"), 8 * max_report + 65536, 1)
    except ValueError:
        # The harness silences its stderr once the jail stands: words there are the setup's.
        msg = err.decode(errors="replace").strip()[-500:]
        if msg:
            raise SandboxUnavailable(explain(f"sandbox could not start: {msg}")) from None
        return Report(failure=("sandbox_error", f"no report (exit {rc})"))
    if not isinstance(env, dict):
        return Report(failure=("sandbox_error", "malformed envelope"))
    if "setup_error" in env:
        raise SandboxUnavailable(explain(f"sandbox setup failed inside the namespaces: {env['setup_error']}"))
    if "supervisor_error" in env or not isinstance(env.get("report"), str):
        return Report(
            failure=("sandbox_error", valid_text(str(env.get("supervisor_error", "malformed envelope"))[:300])[0])
        )
    exit_code = env.get("exit")
    rep = Report(overflow=env.get("overflow") is True, exit_code=exit_code if type(exit_code) is int else 0)
    lines = env["report"].split("\n")
    for ln in lines[:-1]:  # the last piece is empty, or a record cut off when the worker died
        try:
            rec = loads_bounded(ln, max_report, 1)
        except ValueError:
            return Report(failure=("report_corrupted", ""))
        if not _valid(rec, n_tests):
            return Report(failure=("report_corrupted", ""))
        # Every text that leaves here encodes as UTF-8: an output byte that was not UTF-8, or a
        # "\ud800" escape in an error's text, crossed as a lone surrogate.
        for k, v in list(rec.items()):
            if type(v) is str:
                rec[k], replaced = valid_text(v)
                if k == "stdout" and replaced:
                    rec["replaced"] = replaced
        if "fatal" in rec:
            rep.fatal = rec["fatal"]
        elif rec.get("done") is True:
            rep.done = True
        elif "i" in rec:
            if "stop" in rec:
                rep.stop = rec["stop"]
            else:
                rep.tests[rec["i"]] = rec
    return rep


def headline(rep: Report) -> tuple[str, str] | None:
    """Why the whole run failed, whatever each test did (None: look at the tests)."""
    if rep.failure is not None:
        return rep.failure
    if rep.fatal:
        return "syntax_error", rep.fatal
    if rep.overflow:
        return "output_limit", ""
    if not rep.done:
        code = rep.stop if rep.stop is not None else rep.exit_code
        if code < 0:
            return SIGNAL_REASONS.get(-code, f"signal_{-code}"), ""
        # os._exit() in the solution, or a crash before every test was reported
        return "exited_early", f"exit status {code}"
    return None
