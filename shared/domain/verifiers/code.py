"""Code execution against test cases, in the sandbox (shared/domain/sandbox)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.domain.sandbox import Limits, SandboxUnavailable, check_isolation, run_code
from shared.domain.verifiers.registry import Scored, VerifierError

log = logging.getLogger(__name__)

# The most a job may ask of one reward box: CPU seconds, wall seconds and memory of one run,
# and runs at once (each a process tree of up to Limits.nproc processes). The verifier caps
# stored jobs to these; the api refuses a job asking for more.
MAX_CPU_S, MAX_WALL_S, MAX_MEMORY_MB, MAX_PARALLEL = 10, 30.0, 1024, 16
CAPS: dict[str, float] = {
    "cpu_s": MAX_CPU_S,
    "wall_s": MAX_WALL_S,
    "memory_mb": MAX_MEMORY_MB,
    "parallel": MAX_PARALLEL,
}

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
    lim = Limits(
        cpu_s=min(int(cpu_s), MAX_CPU_S),
        wall_s=min(float(wall_s), MAX_WALL_S),
        memory_mb=min(int(memory_mb), MAX_MEMORY_MB),
    )

    def one(text: str) -> float:
        try:
            r = run_code(extract_code(text), cases, lim)
        except SandboxUnavailable:  # the host's fault, the same for every completion: the group's tag
            raise
        except Exception as e:  # noqa: BLE001  (one completion's failure never costs its siblings)
            log.warning("judging a completion failed, scored 0 (judge_error): %s: %s", type(e).__name__, str(e)[:200])
            return Scored(0.0, "judge_error")
        value = (1.0 if r.fraction == 1.0 else 0.0) if all_or_nothing else r.fraction
        return Scored(value, r.reason)

    # Sandboxes are processes: threads only wait on them (each run may hold nproc processes).
    with ThreadPoolExecutor(max_workers=max(1, min(int(parallel), MAX_PARALLEL, len(completions)))) as ex:
        return list(ex.map(one, completions))


def check_code_args(args: Mapping[str, Any]) -> None:
    # At or below 0 nothing can run; above its cap a value would be cut silently: say so instead.
    for key, cap in CAPS.items():
        v = args.get(key)
        if v is None or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if v <= 0:
            raise VerifierError(f"code {key} must be above 0, got {v!r}", arg=key)
        if v > cap:
            raise VerifierError(
                f"code {key} must be at most {cap} (what a shared reward box tolerates), got {v!r}", arg=key
            )
    if "tests" in args:
        parse_tests(args["tests"])
