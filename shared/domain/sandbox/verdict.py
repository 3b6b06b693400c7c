"""Verdicts, computed outside the sandbox: what a run printed or returned vs the expected values.

The expected values never enter the sandbox, so a solution can only change what it
reports about itself, never the rule that judges it.
"""

from __future__ import annotations

import builtins
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from shared.domain.sandbox._harness import loads_bounded
from shared.domain.sandbox.report import Report, headline

log = logging.getLogger(__name__)

MAX_RETURN_DEPTH = 100  # nesting of a function's JSON return value (expected values are plain data)
# The exception kinds a reason may name: Python's own (a fixed set, whatever a solution defines).
BUILTIN_ERRORS = frozenset(
    name for name, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
)
LOGGED_ERROR_CHARS = 300  # of an exception's text in the log
# How close a returned number must be to an expected float (docs/sandbox.md).
FLOAT_REL_TOL, FLOAT_ABS_TOL = 1e-6, 1e-9


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
    replaced: int = 0  # characters of stdout that were not valid UTF-8, each shown as U+FFFD


def judge(tests: list[dict[str, Any]], rep: Report, max_output: int) -> RunResult:
    if rep.failure is not None:  # no usable report: nothing ran, as far as we can tell
        return RunResult([TestResult(False, "not_run") for _ in tests], *rep.failure)
    results = [_judged(t, rep.tests.get(i), max_output) for i, t in enumerate(tests)]
    head = headline(rep)
    if head is not None:
        return RunResult(results, *head)
    failed = [r.reason for r in results if not r.passed]
    return RunResult(results, "ok" if not failed else failed[0])


def program_result(rep: Report) -> ProgramResult:
    """A tool-style run's outcome: its stdout and how it ended."""
    got = rep.tests.get(0) or {}
    res = ProgramResult(stdout=str(got.get("stdout", "")), replaced=int(got.get("replaced", 0)))
    head = headline(rep)
    if head is not None:
        res.reason, res.detail = head
    elif got.get("corrupted"):
        res.reason = "report_corrupted"
    elif got.get("output_limit"):
        res.reason = "output_limit"
    elif "error" in got:
        res.reason, res.detail = error_reason(str(got["error"])), str(got["error"])
    elif got.get("exit") not in (None, "0", "None"):
        # sys.exit(<non-zero>): the program says it failed; what it printed still comes back.
        res.reason, res.detail = "runtime_error:SystemExit", f"exit status {got['exit']}"
    if res.replaced and not res.detail:
        res.detail = f"stdout was not valid UTF-8: {res.replaced} characters shown as U+FFFD"
    return res


def error_reason(error: str) -> str:
    """The reason of a test that raised: the harness reports "Kind: message". The reason becomes
    a reward tag, a Prometheus label and a metric key, and the solution names its exception
    classes (a 100,000-character class name made a 100 kB label series that never expired),
    so the kind is one of Python's own exception names, or "other"; the text goes to the log."""
    kind = error.split(":", 1)[0]
    if kind in BUILTIN_ERRORS:
        return f"runtime_error:{kind}"
    log.info("a solution raised an exception of its own (runtime_error:other): %s", error[:LOGGED_ERROR_CHARS])
    return "runtime_error:other"


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _same(expected: Any, got: Any) -> bool:
    """Does `got` (what the solution returned, through JSON) match `expected`? The expected
    value's type decides the rule (docs/sandbox.md, "How a verdict is reached"):
    - a bool matches only the same bool (1 and 1.0 are not True);
    - an int matches an equal int, or a float that is integral and exactly equal (1000000.0
      is not 1000001, float(2**64) is not 2**64 + 12345);
    - a float matches an int or float within 1e-6 relative (1e-9 absolute) of it;
    - a list matches a list of as many items, item by item (JSON makes tuples lists on both
      sides); a dict the same keys, value by value; a string or null only itself.
    Never raises for what a solution returns: an int too large for a float is simply not close."""
    if isinstance(expected, bool):
        return isinstance(got, bool) and got == expected
    if isinstance(expected, int):
        if isinstance(got, bool):
            return False
        if isinstance(got, float):
            return got.is_integer() and got == expected  # int == float is exact in Python, at any size
        return isinstance(got, int) and got == expected
    if isinstance(expected, float):
        if isinstance(got, bool) or not isinstance(got, int | float):
            return False
        try:
            return math.isclose(got, expected, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
        except OverflowError:  # an int beyond any float is close to no float
            return False
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(_same(e, g) for e, g in zip(expected, got, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(_same(expected[k], got[k]) for k in expected)
        )
    return type(got) is type(expected) and got == expected


def _judged(test: dict[str, Any], got: dict[str, Any] | None, max_output: int) -> TestResult:
    """One test's verdict. Whatever goes wrong while judging it fails that test alone, with
    the reason: an exception here must never reach the caller, where it would zero every
    completion of the group (a solution returning 10 ** 400 where 1.5 was expected did)."""
    try:
        return _judge_one(test, got, max_output)
    except Exception as e:  # noqa: BLE001
        log.warning("judging a test failed, scored 0 (judge_error): %s: %s", type(e).__name__, str(e)[:200])
        return TestResult(False, "judge_error")


def _judge_one(test: dict[str, Any], got: dict[str, Any] | None, max_output: int) -> TestResult:
    if got is None:
        return TestResult(False, "not_run")
    if got.get("corrupted"):
        return TestResult(False, "report_corrupted")
    if got.get("output_limit"):
        return TestResult(False, "output_limit")
    if "error" in got:
        return TestResult(False, error_reason(str(got["error"])))
    if "call" in test:
        try:
            ret = loads_bounded(got.get("ret", "null"), 6 * max_output + 4096, MAX_RETURN_DEPTH)
        except ValueError:
            return TestResult(False, "wrong_answer")
        # the expected value is normalised through JSON too (tuples -> lists)
        try:
            ok = _same(json.loads(json.dumps(test.get("expected"))), ret)
        except RecursionError:  # an expected value nested beyond reason: nothing returned matches it
            ok = False
        return TestResult(ok, "ok" if ok else "wrong_answer")
    ok = _normalize(str(got.get("stdout", ""))) == _normalize(str(test.get("stdout", "")))
    return TestResult(ok, "ok" if ok else "wrong_answer")
