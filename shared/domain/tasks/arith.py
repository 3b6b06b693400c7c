"""Arithmetic: "a+b=" -> the exact sum. The demo task; small enough for a ~1M-param model.

The held-out split is fixed by a hash of the operands, so train and held-out never
share a problem whatever the seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from shared.domain.tasks.base import TaskItem

HELDOUT_PERMILLE = 150


def _is_heldout(a: int, b: int) -> bool:
    # Knuth multiplicative hash: a stable split that does not depend on Python's hash seed.
    return ((a * 1009 + b) * 2654435761 % 2**32) % 1000 < HELDOUT_PERMILLE


@dataclass
class ArithTask:
    name: str = "arith"
    max_operand: int = 29

    def _item(self, a: int, b: int) -> TaskItem:
        return TaskItem(item_id=f"{a}+{b}", prompt=f"{a}+{b}=", fields={"answer": str(a + b)})

    def all_pairs(self, heldout: bool) -> list[tuple[int, int]]:
        n = self.max_operand + 1
        return [(a, b) for a in range(n) for b in range(n) if _is_heldout(a, b) == heldout]

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        pairs = self.all_pairs(heldout=False)
        rng = random.Random(seed)
        while True:  # epochs of shuffled pairs
            rng.shuffle(pairs)
            for a, b in pairs:
                yield self._item(a, b)

    def heldout_items(self, n: int) -> list[TaskItem]:
        pairs = self.all_pairs(heldout=True)
        random.Random(1234).shuffle(pairs)
        return [self._item(a, b) for a, b in pairs[:n]]

    def demonstration(self, item: TaskItem, rng: random.Random, correct_fraction: float) -> str:
        """An SFT target for the warm-start: right with probability correct_fraction.

        The wrong ones are one specific slip (a trailing "0") so that the warm-started
        policy's modal answer is wrong: GRPO then has a real job (find and sharpen the
        right mode), and held-out accuracy shows whether it generalised.
        """
        answer = item.fields["answer"]
        if rng.random() < correct_fraction:
            return answer
        return answer + "0"  # the slip: a trailing digit after the right sum

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        """>>> ArithTask().score(" 12", {"answer": "12"})
        {'correct': 1.0}
        """
        return {"correct": 1.0 if completion.strip() == fields["answer"] else 0.0}
