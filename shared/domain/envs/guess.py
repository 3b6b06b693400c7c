"""A number-guessing game with a verifiable end state, and its task ("guess").

The secret is an integer in [lo, hi] (the item's `secret` field); the prompt never shows
it. Each model turn is a guess ending in a newline; the environment answers `up` or
`down` (or `?` for anything that is not a number). The episode ends when the guess is
right; the task's verifier checks the final guess, and every guess after the first costs
`turn_cost` (a reward part of the environment), so a binary search earns the most.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from shared.domain.envs.base import StepResult
from shared.domain.tasks.base import TaskItem


class GuessEnv:
    name = "guess"
    stop = ("\n",)

    def __init__(self, turn_cost: float = 0.05) -> None:
        self.turn_cost = turn_cost
        self.secret = 0
        self.guesses = 0

    def reset(self, prompt: str, fields: dict[str, str]) -> str:
        self.secret, self.guesses = int(fields["secret"]), 0
        return prompt

    def step(self, text: str) -> StepResult:
        self.guesses += 1
        try:
            g = int(text.strip())
        except ValueError:
            return StepResult(observation="?\n", tool_call=True, tool_error=True)
        if g == self.secret:
            cost = -self.turn_cost * (self.guesses - 1)
            return StepResult(done=True, answer=str(g), tool_call=True, reward_parts={"guess_turns": cost})
        return StepResult(observation="up\n" if g < self.secret else "down\n", tool_call=True)


@dataclass
class GuessTask:
    name: str = "guess"
    lo: int = 0
    hi: int = 15

    def _item(self, k: int, secret: int) -> TaskItem:
        return TaskItem(item_id=f"g{k}", prompt=f"guess {self.lo}-{self.hi}:\n", fields={"secret": str(secret)})

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        rng, k = random.Random(seed), 0
        while True:
            k += 1
            yield self._item(k, rng.randint(self.lo, self.hi))

    def heldout_items(self, n: int) -> list[TaskItem]:
        # The prompt does not depend on the secret, so held-out games are simply every secret in turn.
        span = self.hi - self.lo + 1
        return [self._item(-1 - k, self.lo + k % span) for k in range(n)]

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        return {"correct": 1.0 if completion.strip() == fields["secret"] else 0.0}
