"""Built-in synthetic tasks that need no files: math word problems and small code tasks.

Both split train / held-out by a hash of the item id, like `arith`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

from shared.domain.tasks.base import TaskItem, VerifiedTask
from shared.task_spec import VerifierRef

HELDOUT_FRACTION = 0.15


def _heldout(item_id: str) -> bool:
    return int(hashlib.sha256(item_id.encode()).hexdigest()[:8], 16) / 16**8 < HELDOUT_FRACTION


def _split_stream(make: Callable[[random.Random], TaskItem], seed: int, heldout: bool) -> Iterator[TaskItem]:
    rng = random.Random(seed)
    while True:
        item = make(rng)
        if _heldout(item.item_id) == heldout:
            yield item


def _frac(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


# -- math word problems ---------------------------------------------------------------
NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana"]
THINGS = ["apples", "marbles", "stamps", "books", "shells", "coins"]


def _word_problem(rng: random.Random) -> TaskItem:
    kind = rng.randrange(4)
    who, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 20)
    if kind == 0:
        q = f"{who} has {a} {thing}, gets {b} more, then gives away {c}. How many {thing} does {who} have now?"
        ans = str(a + b - c)
    elif kind == 1:
        q = f"{who} buys {c} boxes with {b} {thing} in each. How many {thing} is that in total?"
        ans = str(b * c)
    elif kind == 2:
        d = rng.randint(2, 9)
        q = f"{who} shares {a} {thing} equally among {d} friends. How many does each friend get?"
        ans = _frac(Fraction(a, d))  # a fraction when it does not divide: math-verify's job
    else:
        p, q2 = rng.randint(1, 5), rng.randint(2, 8)
        q = f"A recipe needs {p}/{q2} of a cup of flour per batch. How many cups for {c} batches?"
        ans = _frac(Fraction(p * c, q2))
    item_id = "mw-" + hashlib.sha256(q.encode()).hexdigest()[:12]
    prompt = q + " Give the final answer as \\boxed{...}."
    return TaskItem(item_id=item_id, prompt=prompt, fields={"answer": ans})


class MathWordTask(VerifiedTask):
    """Word problems with numeric (integer or fraction) answers, scored by math equivalence."""

    name = "mathword"

    def __init__(self) -> None:
        self.verifiers = [VerifierRef(name="math", part="correct")]

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        return _split_stream(_word_problem, seed, heldout=False)

    def heldout_items(self, n: int) -> list[TaskItem]:
        it = _split_stream(_word_problem, 1234, heldout=True)
        seen: dict[str, TaskItem] = {}
        for _ in range(50 * max(n, 1)):  # bounded: the space of problems is finite
            item = next(it)
            seen.setdefault(item.item_id, item)
            if len(seen) >= n:
                break
        return list(seen.values())[:n]


# -- small code tasks -------------------------------------------------------------------
_CODE_FAMILIES: list[tuple[str, str, Callable[..., Any], Callable[[random.Random], list[Any]]]] = [
    (
        "sum_sq",
        "returns the sum of the squares of the integers in the list `xs`",
        lambda xs: sum(x * x for x in xs),
        lambda r: [[r.randint(-9, 9) for _ in range(r.randint(0, 6))]],
    ),
    (
        "span",
        "returns max(xs) - min(xs) for a non-empty list of integers `xs`",
        lambda xs: max(xs) - min(xs),
        lambda r: [[r.randint(-50, 50) for _ in range(r.randint(1, 6))]],
    ),
    (
        "count_even",
        "returns how many integers in the list `xs` are even",
        lambda xs: sum(x % 2 == 0 for x in xs),
        lambda r: [[r.randint(0, 99) for _ in range(r.randint(0, 8))]],
    ),
    (
        "rev_words",
        "returns the string `s` with the order of its space-separated words reversed",
        lambda s: " ".join(s.split()[::-1]),
        lambda r: [" ".join(r.choice(["a", "bc", "def", "gh", "ij"]) for _ in range(r.randint(1, 5)))],
    ),
    (
        "scale",
        "returns a new list with every integer in `xs` multiplied by `k`",
        lambda xs, k: [x * k for x in xs],
        lambda r: [[r.randint(-5, 5) for _ in range(r.randint(0, 5))], r.randint(-3, 3)],
    ),
]


def _code_item(rng: random.Random) -> TaskItem:
    fam, desc, ref, gen = rng.choice(_CODE_FAMILIES)
    fname = rng.choice(["solve", "f", "compute"])
    case_seed = rng.randrange(10_000)
    crng = random.Random(case_seed)
    tests = []
    for _ in range(4):
        args = gen(crng)
        tests.append({"call": fname, "args": args, "expected": ref(*json.loads(json.dumps(args)))})
    params = "xs" if fam not in ("rev_words", "scale") else ("s" if fam == "rev_words" else "xs, k")
    prompt = f"Write a Python function `{fname}({params})` that {desc}. Answer with one ```python code block."
    return TaskItem(item_id=f"code-{fam}-{fname}-{case_seed}", prompt=prompt, fields={"tests": json.dumps(tests)})


class CodeTask(VerifiedTask):
    """Write a small function; scored by running it against tests in the sandbox."""

    name = "code"

    def __init__(self) -> None:
        self.verifiers = [VerifierRef(name="code", part="tests_passed")]

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        return _split_stream(_code_item, seed, heldout=False)

    def heldout_items(self, n: int) -> list[TaskItem]:
        it = _split_stream(_code_item, 1234, heldout=True)
        return [next(it) for _ in range(n)]
