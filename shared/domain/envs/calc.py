"""The calculator tool environment and its companion task, 3-digit sums ("arith3").

A model turn that contains `<calc>EXPR</calc>` calls the tool: the expression is
evaluated by a small arithmetic interpreter (never Python's eval: the model's text is
untrusted) and the episode continues with the observation `=VALUE` and a newline. A turn
without a tool call is the final answer, scored by the task's verifier.

    123+456=<calc>123+456</calc>=579        (prompt, model turn 1, observation)
    579<eos>                                 (model turn 2: the answer)

With `submit_last_result` (the default), an empty final turn (just EOS) submits the last
tool result as the answer: "return what the tool said". The tiny demo model answers that
way; it cannot yet copy a number reliably, and the demo is about learning to call the tool.

The tiny demo model cannot add 3-digit numbers in its head reliably, so on "arith3" the
tool is the way to be right: RL should teach it to call the tool.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from shared.domain.envs.base import EnvError, StepResult, ToolEnv
from shared.domain.tasks.base import TaskItem

MAX_EXPR_CHARS = 64
MAX_ABS = 10**15  # intermediate values beyond this are refused (no 9**9**9 memory bombs)

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    pass


def calc(expr: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses on numeric literals, within bounds."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"syntax: {e.msg}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            v = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
                raise CalcError("power too large")
            try:
                v = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise CalcError("division by zero") from None
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            v = _UNARY[type(node.op)](ev(node.operand))
        else:
            raise CalcError(f"not allowed: {type(node).__name__}")
        if isinstance(v, complex) or abs(v) > MAX_ABS:
            raise CalcError("value out of range")
        return v

    v = ev(tree.body)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return round(v, 6) if isinstance(v, float) else v


class CalcEnv(ToolEnv):
    """Tool calls `<calc>EXPR</calc>`, answered `=VALUE` (or `=error`); see ToolEnv for the
    episode rules (final answer, submit_last_result, max_calls, tool_error_penalty)."""

    name = "calc"

    def __init__(
        self, tag: str = "calc", max_calls: int = 3, submit_last_result: bool = True, tool_error_penalty: float = 0.0
    ) -> None:
        if not isinstance(tag, str) or not re.fullmatch(r"[a-z_]{1,16}", tag):
            raise EnvError("calc: tag must be 1-16 lowercase letters or underscores")
        super().__init__(
            f"<{tag}>",
            f"</{tag}>",
            max_calls=max_calls,
            submit_last_result=submit_last_result,
            tool_error_penalty=tool_error_penalty,
        )

    def call(self, arg: str) -> StepResult:
        try:
            value = str(calc(arg))
        except CalcError:
            return self.failed("=error\n")
        return self.result(value, f"={value}\n")


# -- the companion task ---------------------------------------------------------------------
def _is_heldout(a: int, b: int) -> bool:
    # Same stable hash split as "arith" (independent of Python's hash seed).
    return ((a * 1009 + b) * 2654435761 % 2**32) % 1000 < 150


@dataclass
class Arith3Task:
    """'a+b=' with 3-digit operands; the answer is the exact sum."""

    name: str = "arith3"
    lo: int = 100
    hi: int = 999

    def _item(self, a: int, b: int) -> TaskItem:
        return TaskItem(item_id=f"{a}+{b}", prompt=f"{a}+{b}=", fields={"answer": str(a + b)})

    def _pairs(self, rng: random.Random, heldout: bool) -> Iterator[tuple[int, int]]:
        while True:
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
            if _is_heldout(a, b) == heldout:
                yield a, b

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        return (self._item(a, b) for a, b in self._pairs(random.Random(seed), heldout=False))

    def heldout_items(self, n: int) -> list[TaskItem]:
        pairs = self._pairs(random.Random(1234), heldout=True)
        return [self._item(*next(pairs)) for _ in range(n)]

    def demonstration(self, item: TaskItem, rng: random.Random, correct_fraction: float) -> str:
        """An SFT target: a tool call then the answer with probability correct_fraction, else
        a direct answer (right, but a small model gets those wrong at sampling time)."""
        a, b = item.prompt.removesuffix("=").split("+")
        answer = item.fields["answer"]
        if rng.random() < correct_fraction:
            return f"<calc>{a}+{b}</calc>={answer}\n"  # then an empty turn submits the tool's result
        return answer

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        return {"correct": 1.0 if completion.strip() == fields["answer"] else 0.0}
