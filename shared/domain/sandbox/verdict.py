"""Verdicts, computed outside the sandbox: what a run printed or returned vs the expected values.

The expected values never enter the sandbox, so a solution can only change what it
reports about itself, never the rule that judges it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from shared.domain.sandbox._harness import loads_bounded
from shared.domain.sandbox.report import Report, headline

MAX_RETURN_DEPTH = 100  # nesting of a function's JSON return value (expected values are plain data)


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


@dataclass
class ProgramResult:
    """What one program run printed, and why it ended (RunResult's reason vocabulary)."""

    stdout: str = ""
    reason: str = "ok"  # "ok", "runtime_error:Kind", "wall_time_limit", "output_limit", "syntax_error", ...
    detail: str = ""  # e.g. "ZeroDivisionError: division by zero" (the traceback's last line)
    seconds: float = 0.0


def judge(tests: list[dict[str, Any]], rep: Report, max_output: int) -> RunResult:
    if rep.failure is not None:  # no usable report: nothing ran, as far as we can tell
        return RunResult([TestResult(False, "not_run") for _ in tests], *rep.failure)
    results = [_judge_one(t, rep.tests.get(i), max_output) for i, t in enumerate(tests)]
    head = headline(rep)
    if head is not None:
        return RunResult(results, *head)
    failed = [r.reason for r in results if not r.passed]
    return RunResult(results, "ok" if not failed else failed[0])


def program_result(rep: Report) -> ProgramResult:
    """A tool-style run's outcome: its stdout and how it ended."""
    got = rep.tests.get(0) or {}
    res = ProgramResult(stdout=str(got.get("stdout", "")))
    head = headline(rep)
    if head is not None:
        res.reason, res.detail = head
    elif got.get("corrupted"):
        res.reason = "report_corrupted"
    elif "error" in got:
        res.reason, res.detail = error_reason(str(got["error"])), str(got["error"])
    elif got.get("exit") not in (None, "0", "None"):
        # sys.exit(<non-zero>): the program says it failed; what it printed still comes back.
        res.reason, res.detail = "runtime_error:SystemExit", f"exit status {got['exit']}"
    return res


def error_reason(error: str) -> str:
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


def _judge_one(test: dict[str, Any], got: dict[str, Any] | None, max_output: int) -> TestResult:
    if got is None:
        return TestResult(False, "not_run")
    if got.get("corrupted"):
        return TestResult(False, "report_corrupted")
    if "error" in got:
        return TestResult(False, error_reason(str(got["error"])))
    if "call" in test:
        try:
            ret = loads_bounded(got.get("ret", "null"), 6 * max_output + 4096, MAX_RETURN_DEPTH)
        except ValueError:
            return TestResult(False, "wrong_answer")
        # the expected value is normalised through JSON too (tuples -> lists)
        try:
            ok = _same(ret, json.loads(json.dumps(test.get("expected"))))
        except RecursionError:  # an expected value nested beyond reason: nothing returned matches it
            ok = False
        return TestResult(ok, "ok" if ok else "wrong_answer")
    ok = _normalize(str(got.get("stdout", ""))) == _normalize(str(test.get("stdout", "")))
    return TestResult(ok, "ok" if ok else "wrong_answer")
