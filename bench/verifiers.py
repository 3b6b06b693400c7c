"""Verifier throughput: completions/s for math (math-verify) and code (sandboxed tests).

    .venv/bin/python bench/verifiers.py [--n-math 400] [--n-code 64] [--parallel 2]

Code is shown beside a baseline: the same programs and tests run by a plain,
unsandboxed `python3 -I -S` subprocess each (what isolation costs, as a ratio).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from shared.domain.sandbox import check_isolation, settings
from shared.domain.verifiers import get_verifier

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-math", type=int, default=400)
    ap.add_argument("--n-code", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=2, help="concurrent sandboxes (keep <= cores)")
    a = ap.parse_args()
    print(f"math (math-verify, 1 process)        {bench_math(a.n_math):8.1f} completions/s")
    ok, why = check_isolation()
    if not ok:
        print(f"code: skipped, sandbox unavailable: {why}")
        return
    sb = bench_code(a.n_code, a.parallel)
    base = bench_baseline(a.n_code, a.parallel)
    print(f"code (sandboxed, {a.parallel} at once, 4 tests)  {sb:8.1f} completions/s")
    print(f"code (unsandboxed subprocess baseline)  {base:8.1f} completions/s")
    print(f"sandbox cost: {base / sb:.2f}x the baseline's time per completion")


if __name__ == "__main__":
    main()
