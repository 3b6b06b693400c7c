"""Code execution against test cases, in the sandbox (shared/domain/sandbox)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.domain.sandbox import Limits, SandboxUnavailable, check_isolation, run_code
from shared.domain.verifiers.registry import Scored, VerifierError, register_arg_check, register_verifier

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced code block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def parse_tests(tests: Any) -> list[dict[str, Any]]:
    """Tests as a JSON string (task fields are strings) or a list; each checked for shape."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise VerifierError(f"the 'tests' field is not JSON: {e}") from e
    if not isinstance(tests, list) or not tests:
        raise VerifierError("the 'tests' field must be a non-empty JSON list of test cases")
    for t in tests:
        if not isinstance(t, dict) or not (("stdin" in t and "stdout" in t) or ("call" in t and "expected" in t)):
            raise VerifierError(
                'each test must be {"stdin": ..., "stdout": ...} or {"call": "f", "args": [...], "expected": ...}'
            )
    return tests


@register_verifier("code")
def code_tests(
    completions: Sequence[str],
    tests: Any = None,
    all_or_nothing: bool = False,
    cpu_s: int = 2,
    wall_s: float = 6.0,
    memory_mb: int = 256,
    parallel: int = 4,
    **_: object,
) -> list[float]:
    """Fraction of the `tests` field's cases the completion's code passes (or 1/0 with all_or_nothing).

    Raises SandboxUnavailable where isolation is unavailable: code never runs unsandboxed.
    """
    cases = parse_tests(tests)
    ok, why = check_isolation()
    if not ok:
        raise SandboxUnavailable(f"refusing to run code rewards without isolation: {why}")
    # Limits are capped so a job can loosen them only up to what a shared box tolerates.
    lim = Limits(cpu_s=min(int(cpu_s), 10), wall_s=min(float(wall_s), 30.0), memory_mb=min(int(memory_mb), 1024))

    def one(text: str) -> float:
        r = run_code(extract_code(text), cases, lim)
        value = (1.0 if r.fraction == 1.0 else 0.0) if all_or_nothing else r.fraction
        return Scored(value, r.reason)

    # Sandboxes are processes: threads only wait on them.
    with ThreadPoolExecutor(max_workers=max(1, min(int(parallel), len(completions)))) as ex:
        return list(ex.map(one, completions))


@register_arg_check("code")
def _check_code_args(args: Mapping[str, Any]) -> None:
    # The verifier caps these (cpu_s 10, wall_s 30, memory_mb 1024); at or below 0 nothing can run.
    for key in ("cpu_s", "wall_s", "memory_mb", "parallel"):
        v = args.get(key)
        if v is not None and not isinstance(v, bool) and isinstance(v, int | float) and v <= 0:
            raise VerifierError(f"code {key} must be above 0, got {v!r}", arg=key)
    if "tests" in args:
        parse_tests(args["tests"])
