"""Issue 44, items 1-3 and the sandbox's part of 4: the verdict's comparison rules, one
completion's failure scored alone, the I/O a program gets, and text that cannot be encoded.

Every case runs a real sandbox; nothing is mocked. Skipped only where the sandbox cannot
isolate here (check_isolation says why), like tests/integration/test_sandbox.py.
"""

from __future__ import annotations

import json

import pytest

from shared.domain.sandbox import Limits, check_isolation, run_code, run_program
from shared.domain.verifiers import score_components
from shared.task_spec import VerifierRef

ok, why = check_isolation()
pytestmark = pytest.mark.skipif(not ok, reason=f"sandbox unavailable here: {why}")

TIGHT = Limits(cpu_s=2, wall_s=8.0, max_output=1 << 16)


def returns(value: str, expected: object) -> bool:
    """Whether `def f(): return <value>` passes a test expecting `expected`."""
    r = run_code(f"def f():\n    return {value}\n", [{"call": "f", "args": [], "expected": expected}], TIGHT)
    return r.tests[0].passed


# -- item 1: the expected value's type decides the rule --------------------------------------
@pytest.mark.parametrize(
    ("value", "expected", "passes"),
    [
        ("1000000.0", 1000001, False),  # a float passed for a wrong int
        ("float(2**64)", 2**64 + 12345, False),
        ("1000001.0", 1000001, True),  # integral and exactly equal: the same number
        ("1000001.5", 1000001, False),
        ("1.0", True, False),  # 1.0 passed for True
        ("1", True, False),
        ("True", True, True),
        ("True", 1, False),
        ("True", 1.0, False),
        ("0.1 + 0.2", 0.3, True),  # floats within 1e-6 relative
        ("3", 3.0, True),
        ("3.001", 3.0, False),
        ("[1.0000000001, {'a': 2.0}]", [1.0, {"a": 2}], True),  # the rules hold inside lists and dicts
        ("[1, {'a': 2.5}]", [1.0, {"a": 2}], False),
        ("(1, 2.0)", (1, 2), True),  # tuples are lists on both sides (JSON)
        ("[True]", [1], False),
        ("{'a': 1.0}", {"a": True}, False),
        ("'1'", 1, False),
        ("None", 0, False),
    ],
)
def test_comparison_follows_the_expected_type(value: str, expected: object, passes: bool) -> None:
    assert returns(value, expected) is passes


# -- item 2: one completion's overflow is its own -----------------------------------------------
def test_values_no_float_holds_are_wrong_answers_not_exceptions() -> None:
    assert returns("10 ** 400", 1.5) is False  # OverflowError in math.isclose, raised out of run_code
    assert returns("1e308", 10**400) is False  # a float where an int beyond any float is expected
    assert returns("-10 ** 400", -1.5) is False
    assert returns("10 ** 400", 10**400) is True


def test_overflow_does_not_zero_the_group() -> None:
    tests = json.dumps([{"call": "half", "args": [3], "expected": 1.5}, {"call": "half", "args": [5], "expected": 2.5}])
    group = [
        "```python\ndef half(x):\n    return x / 2\n```",
        "```python\ndef half(x):\n    return 10 ** 400\n```",
        "```python\ndef half(x):\n    return x // 2\n```",
        "```python\ndef half(x):\n    return x / 2\n```",
    ]
    parts = score_components([VerifierRef(name="code", part="tests")], group, {"tests": tests})
    assert [p["tests"] for p in parts] == [1.0, 0.0, 0.0, 1.0], parts
    assert not any(k.startswith("tests!error") for p in parts for k in p), parts


def test_a_test_that_cannot_be_judged_fails_alone() -> None:
    # An expected value JSON cannot hold (run_code's callers pass plain data; a bug might not):
    # that test fails with the reason, the next is judged as usual, and nothing raises.
    tests = [{"call": "f", "args": [], "expected": {1, 2}}, {"call": "f", "args": [], "expected": 7}]
    r = run_code("def f():\n    return 7\n", tests, TIGHT)
    assert [(t.passed, t.reason) for t in r.tests] == [(False, "judge_error"), (True, "ok")], r


# -- item 3: the I/O a program gets -------------------------------------------------------------
SUMS = [{"stdin": "1 2\n3 4\n", "stdout": "10"}, {"stdin": "5 5\n0 1\n", "stdout": "11"}]
# PyRival's FastIO template (pyrival/misc/FastIO.py, Apache-2.0), as Codeforces solutions paste
# it: reads fd 0 sized by fstat, writes fd 1 only when flushed (at exit, by the interpreter).
FASTIO = """\
import os, sys
from io import BytesIO, IOBase
BUFSIZE = 8192
class FastIO(IOBase):
    newlines = 0
    def __init__(self, file):
        self._fd = file.fileno()
        self.buffer = BytesIO()
        self.writable = "x" in file.mode or "r" not in file.mode
        self.write = self.buffer.write if self.writable else None
    def read(self):
        while True:
            b = os.read(self._fd, max(os.fstat(self._fd).st_size, BUFSIZE))
            if not b:
                break
            ptr = self.buffer.tell()
            self.buffer.seek(0, 2), self.buffer.write(b), self.buffer.seek(ptr)
        self.newlines = 0
        return self.buffer.read()
    def readline(self):
        while self.newlines == 0:
            b = os.read(self._fd, max(os.fstat(self._fd).st_size, BUFSIZE))
            self.newlines = b.count(b"\\n") + (not b)
            ptr = self.buffer.tell()
            self.buffer.seek(0, 2), self.buffer.write(b), self.buffer.seek(ptr)
        self.newlines -= 1
        return self.buffer.readline()
    def flush(self):
        if self.writable:
            os.write(self._fd, self.buffer.getvalue())
            self.buffer.truncate(0), self.buffer.seek(0)
class IOWrapper(IOBase):
    def __init__(self, file):
        self.buffer = FastIO(file)
        self.flush = self.buffer.flush
        self.writable = self.buffer.writable
        self.write = lambda s: self.buffer.write(s.encode("ascii"))
        self.read = lambda: self.buffer.read().decode("ascii")
        self.readline = lambda: self.buffer.readline().decode("ascii")
sys.stdin, sys.stdout = IOWrapper(sys.stdin), IOWrapper(sys.stdout)
input = lambda: sys.stdin.readline().rstrip("\\r\\n")
"""
IDIOMS = {
    "input": "print(sum(map(int, input().split())) + sum(map(int, input().split())))",
    "stdin.readline": "import sys\nprint(sum(int(x) for _ in range(2) for x in sys.stdin.readline().split()))",
    "stdin iterated": "import sys\nprint(sum(int(x) for line in sys.stdin for x in line.split()))",
    "stdin.read": "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
    "stdin.buffer.read": "import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))",
    "open(0)": "print(sum(map(int, open(0).read().split())))",
    "open(0, 'rb')": "print(sum(map(int, open(0, 'rb').read().split())))",
    "os.read sized by fstat": "import os\nprint(sum(map(int, os.read(0, os.fstat(0).st_size).split())))",
    "os.read": "import os\nprint(sum(map(int, os.read(0, 1 << 20).split())))",
    "stdout.buffer.write": "import sys\nsys.stdout.buffer.write(str(sum(map(int, sys.stdin.buffer.read().split()))).encode())",
    "stdout.write": "import sys\nsys.stdout.write(str(sum(map(int, sys.stdin.read().split()))) + '\\n')",
    "os.write(1)": "import os\nos.write(1, b'%d\\n' % sum(map(int, os.read(0, 99).split())))",
    "print to stderr too": "import sys\nprint('debug', file=sys.stderr)\nprint(sum(map(int, open(0).read().split())))",
    "PyRival FastIO": FASTIO
    + "a, b = map(int, input().split())\nc, d = map(int, input().split())\nprint(a + b + c + d)",
    "PyRival FastIO, all at once": FASTIO + "print(sum(map(int, sys.stdin.read().split())))",
}


@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_competitive_programming_io_idioms_pass(idiom: str) -> None:
    r = run_code(IDIOMS[idiom], SUMS, TIGHT)
    assert r.fraction == 1.0 and r.reason == "ok", r


def test_stdin_is_read_only_and_its_own_per_test() -> None:
    code = (
        "import os\n"
        "try:\n    os.write(0, b'9 9 9')\nexcept OSError as e:\n    print('refused', e.errno)\n"
        "print(sum(map(int, open(0).read().split())))\n"
    )
    r = run_program(code, "1 2 3", TIGHT)
    assert (r.reason, r.stdout) == ("ok", "refused 1\n6\n"), r  # EPERM: the input is sealed
    # Each test reads its own input, whatever the one before did.
    tests = [{"stdin": "1 2 3", "stdout": "refused 1\n6"}, {"stdin": "4", "stdout": "refused 1\n4"}]
    assert run_code(code, tests, TIGHT).fraction == 1.0


def test_an_input_above_the_file_size_limit_is_still_read_whole() -> None:
    # The input is written before the run's file size limit applies (fsize_mb 4); the solution's
    # own files stay capped.
    big = "7 " * (3 << 20)  # 6 MB
    r = run_program("import sys\nprint(len(sys.stdin.read().split()))", big, TIGHT)
    assert (r.reason, r.stdout) == ("ok", f"{3 << 20}\n"), r
    r = run_program("open('f', 'w').write('x' * (5 << 20))\nprint('wrote')", "", TIGHT)
    assert r.reason == "runtime_error:OSError" and r.stdout == "", r


def test_output_counts_until_the_program_ends() -> None:
    # Buffered output reaches the judge when the program ends, also after an error.
    r = run_program("import sys\nsys.stdout.write('partial')\n1 / 0\n", limits=TIGHT)
    assert (r.stdout, r.reason) == ("partial", "runtime_error:ZeroDivisionError"), r
    r = run_program("import sys\nprint('x' * 10)\nsys.exit(0)\n", limits=TIGHT)
    assert (r.stdout, r.reason) == ("x" * 10 + "\n", "ok"), r
    # A program's own OverflowError is a runtime error, not the output cap.
    r = run_program("import math\nmath.exp(1000)\n", limits=TIGHT)
    assert r.reason == "runtime_error:OverflowError", r
    r = run_program("import os\nwhile True:\n    os.write(1, b'x' * 4096)\n", limits=Limits(max_output=10_000))
    assert r.reason == "output_limit" and r.stdout == "", r


# -- item 4 (the sandbox's part): what leaves the sandbox encodes as UTF-8 ----------------------
def encodable(*texts: str) -> bool:
    return all(json.dumps(t, ensure_ascii=False).encode() for t in texts)


def test_a_lone_surrogate_printed_is_the_programs_error_and_encodes() -> None:
    r = run_program('print("a")\nprint("b\\ud800c")\n', limits=TIGHT)
    assert r.reason == "runtime_error:UnicodeEncodeError" and r.stdout == "a\n", r
    assert encodable(r.stdout, r.detail)


def test_bytes_that_are_not_utf8_come_back_replaced_and_said() -> None:
    r = run_program("import sys\nsys.stdout.buffer.write(b'x\\xffy\\xed\\xa0\\x80z')\n", limits=TIGHT)
    assert r.reason == "ok" and r.stdout == "x\ufffdy\ufffd\ufffd\ufffdz", r
    assert r.replaced == 4 and "not valid UTF-8" in r.detail, r
    assert encodable(r.stdout, r.detail)
    r = run_program("raise ValueError('bad \\ud800 text')\n", limits=TIGHT)
    assert r.reason == "runtime_error:ValueError" and r.detail == "ValueError: bad \ufffd text", r


# -- issue 47 item 4: a reason names no class the solution chose ---------------------------------
def test_exception_classes_of_the_solutions_own_are_one_category() -> None:
    code = "raise type('E' * 100_000, (Exception,), {})('boom')\n"
    r = run_code(code, [{"stdin": "", "stdout": ""}], TIGHT)
    assert r.reason == "runtime_error:other", r.reason[:100]
    r = run_code("class ValueError2(Exception):\n    pass\nraise ValueError2()\n", [{"stdin": "", "stdout": ""}], TIGHT)
    assert r.reason == "runtime_error:other"
    assert run_code("int('x')\n", [{"stdin": "", "stdout": ""}], TIGHT).reason == "runtime_error:ValueError"
    p = run_program(code, limits=TIGHT)
    assert p.reason == "runtime_error:other" and len(p.detail) < 400, len(p.detail)
