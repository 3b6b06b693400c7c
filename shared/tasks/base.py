"""The task interface and its registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class TaskItem:
    """One problem: the prompt text and the fields its verifier needs (e.g. the answer)."""

    item_id: str
    prompt: str
    fields: dict[str, str] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        """An endless, seeded stream of training items (never a held-out one)."""
        ...

    def heldout_items(self, n: int) -> list[TaskItem]:
        """The first n items of the fixed held-out split."""
        ...

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        """Reward parts of one completion; the reward is their sum (see `total`)."""
        ...


_TASKS: dict[str, Callable[[], Task]] = {}


def register_task(name: str, factory: Callable[[], Task]) -> None:
    _TASKS[name] = factory


def get_task(name: str) -> Task:
    try:
        return _TASKS[name]()
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known: {sorted(_TASKS)}") from None


def task_names() -> list[str]:
    return sorted(_TASKS)


def total(parts: dict[str, float]) -> float:
    return float(sum(parts.values()))
