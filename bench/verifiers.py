"""Verifier throughput: completions/s for math (math-verify) and code (sandboxed tests).

    .venv/bin/python bench/verifiers.py [--n-math 400] [--n-code 64] [--parallel 2] [--out bench/results/verifiers.md]

Code is shown beside a baseline: the same programs and tests run by a plain,
unsandboxed `python3 -I -S` subprocess each (what isolation costs, as a ratio).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.domain.sandbox import check_isolation, settings  # noqa: E402
from shared.domain.verifiers import get_verifier  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command, table  # noqa: E402

MATH = [
    ("\\boxed{\\frac{2}{4}}", "\\frac12"),
    ("The answer is $0.5$.", "1/2"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt2}"),
    ("so x = 42", "42"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("no idea", "7"),
]
CODE = "```python\ndef f(xs):\n    return sum(x * x for x in xs)\n```"
TESTS = [{"call": "f", "args": [[i, i + 1, -i]], "expected": i * i * 2 + (i + 1) ** 2} for i in range(4)]
BASELINE = (
    "import json, sys\n"
    "p = json.loads(sys.stdin.read())\n"
    "g = {}\nexec(p['code'], g)\n"
    "print(json.dumps([g[t['call']](*t['args']) for t in p['tests']]))\n"
)


def bench_math(n: int) -> float:
    fn = get_verifier("math")
    fn(["\\boxed{1}"], answer="1")  # import math-verify / sympy outside the clock
    t0 = time.perf_counter()
    for i in range(n):
        comp, ans = MATH[i % len(MATH)]
        fn([comp], answer=ans + " " * (i // len(MATH) % 2))  # vary the gold to defeat its parse cache
    return n / (time.perf_counter() - t0)


def bench_code(n: int, parallel: int) -> float:
    fn = get_verifier("code")
    tests = json.dumps(TESTS)
    fn([CODE], tests=tests)
    t0 = time.perf_counter()
    got = fn([CODE] * n, tests=tests, parallel=parallel)
    dt = time.perf_counter() - t0
    assert all(x == 1.0 for x in got), got
    return n / dt


def bench_baseline(n: int, parallel: int) -> float:
    payload = json.dumps({"code": CODE.split("\n", 1)[1].rsplit("```", 1)[0], "tests": TESTS}).encode()

    def one(_: int) -> None:
        subprocess.run([settings().python, "-I", "-S", "-c", BASELINE], input=payload, capture_output=True, check=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(parallel) as ex:
        list(ex.map(one, range(n)))
    return n / (time.perf_counter() - t0)


def figures(res: dict[str, Any]) -> list[Figure]:
    """The headline figures of a results JSON: math completions/s, and the sandbox's time per code
    completion against an unsandboxed subprocess's (when the sandbox could run)."""
    out = [figure("math verifier (math-verify, 1 process)", f"{res['math_per_s']:.1f} completions/s")]
    if code := res.get("code_per_s"):
        title = f"code verifier, time per completion sandboxed / unsandboxed subprocess ({res['parallel']} at once)"
        base = res["baseline_per_s"]
        out.append(figure(title, f"{code:.1f} completions/s", f"unsandboxed {base:.1f} completions/s", base / code))
    return out


def report(res: dict[str, Any], cmd: str) -> str:
    rows = [("math (math-verify, 1 process)", f"{res['math_per_s']:.1f}")]
    if res.get("code_per_s"):
        rows += [
            (f"code (sandboxed, {res['parallel']} at once, 4 tests)", f"{res['code_per_s']:.1f}"),
            ("code (unsandboxed subprocess baseline)", f"{res['baseline_per_s']:.1f}"),
        ]
        cost = f"Sandbox cost: **{res['baseline_per_s'] / res['code_per_s']:.2f}x** the baseline's time per completion."
    else:
        cost = f"Code: skipped, sandbox unavailable: {res['code_skipped']}"
    lines = ["## Verifier throughput", "", f"`{cmd}`", "", *table(["verifier", "completions/s"], rows), "", cost]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-math", type=int, default=400)
    ap.add_argument("--n-code", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=2, help="concurrent sandboxes (keep <= cores)")
    ap.add_argument("--out", type=Path, default=None, help="The page (and its .json beside it); default: stdout only.")
    a = ap.parse_args()
    cmd = shown_command(__file__)
    res: dict[str, Any] = {"n_math": a.n_math, "n_code": a.n_code, "parallel": a.parallel}
    res["math_per_s"] = bench_math(a.n_math)
    ok, why = check_isolation()
    if ok:
        res["code_per_s"] = bench_code(a.n_code, a.parallel)
        res["baseline_per_s"] = bench_baseline(a.n_code, a.parallel)
    else:
        res["code_skipped"] = why
    emit(report(res, cmd), a.out, res, figures=figures(res), command=cmd)


if __name__ == "__main__":
    main()
