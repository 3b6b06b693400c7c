"""Counting up: "a+b=" -> "a a+1 ... a+b", scored on the last number. A long-completion task.

The same problems and held-out split as "arith", but the answer is reached by writing
every number from a to a+b (b + 1 numbers, up to ~90 tokens with the byte tokenizer,
~45 on average): a stand-in for a reasoning trace, so that generation, not the optimizer
step, is most of a GRPO step, as it is for real models with long chains of thought.
bench/trl_compare.py uses it to compare burstrl with TRL where generation dominates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.domain.tasks.arith import ArithTask
from shared.domain.tasks.base import TaskItem

# The longest completion: 30 numbers of up to 2 digits plus spaces, and EOS.
MAX_COMPLETION_TOKENS = 96


def trace(start: int, stop: int) -> str:
    """The numbers from start to stop, space-separated.

    >>> trace(7, 10)
    '7 8 9 10'
    """
    return " ".join(str(n) for n in range(start, stop + 1))


@dataclass
class CountUpTask(ArithTask):
    name: str = "countup"

    def _item(self, a: int, b: int) -> TaskItem:
        return TaskItem(item_id=f"{a}+{b}", prompt=f"{a}+{b}=", fields={"answer": str(a + b), "start": str(a)})

    def demonstration(self, item: TaskItem, rng: random.Random, correct_fraction: float) -> str:
        """An SFT target: the right count with probability correct_fraction, else one number too far.

        As in "arith", the slip makes the warm-started policy's modal answer wrong, so GRPO has
        to learn where to stop.
        """
        start, answer = int(item.fields["start"]), int(item.fields["answer"])
        return trace(start, answer if rng.random() < correct_fraction else answer + 1)

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        """Right when the count starts at a, climbs by one and ends at a+b.

        >>> CountUpTask().score(" 7 8 9", {"answer": "9", "start": "7"})
        {'correct': 1.0}
        >>> CountUpTask().score("9", {"answer": "9", "start": "7"})
        {'correct': 0.0}
        """
        start = int(fields.get("start", fields["answer"]))
        ok = completion.split() == trace(start, int(fields["answer"])).split()
        return {"correct": 1.0 if ok else 0.0}
