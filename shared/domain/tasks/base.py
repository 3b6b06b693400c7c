"""The task interface and its registry (the built-ins: shared/domain/catalog.py, loaded on first use)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from shared.domain import catalog
from shared.plugins import Registry


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


# A later registration of a name replaces the earlier one (a plugin's task over a built-in).
_TASKS: Registry[Callable[[], Task]] = Registry("task", catalog.TASKS, replace_silently=True)
# Families of tasks named "<prefix><name>", built with options (`task_spec.args`): "rg:<dataset>".
_FAMILIES: Registry[Callable[[str, dict[str, Any]], Task]] = Registry(
    "task family", catalog.TASK_FAMILIES, replace_silently=True
)


def register_task(name: str, factory: Callable[[], Task]) -> None:
    _TASKS.register(name, factory)


def register_task_family(prefix: str, factory: Callable[[str, dict[str, Any]], Task]) -> None:
    _FAMILIES.register(prefix, factory)


def make_task(name: str, args: dict[str, Any] | None = None) -> Task:
    """A task by name with its options; only task families take options."""
    families = _FAMILIES.items()
    for prefix, family in families:
        if name.startswith(prefix):
            return family(name[len(prefix) :], dict(args or {}))
    if args:
        raise ValueError(
            f"task_spec.args: task {name!r} takes no options; only task families do "
            f"({', '.join(p for p, _ in families)}<name>)"
        )
    factory = _TASKS.get(name)
    if factory is None:
        known = "".join(f", or {p}<name>" for p, _ in families)
        raise KeyError(f"unknown task {name!r}; known: {_TASKS.names()}{known}")
    return factory()


def get_task(name: str) -> Task:
    """A task by name, with default options."""
    return make_task(name)


def task_names() -> list[str]:
    return _TASKS.names()


def total(parts: dict[str, float]) -> float:
    return float(sum(parts.values()))


# -- configured tasks (verifiers, templates, file sources) ---------------------------------
def score_many(
    task: Task,
    completions: list[str],
    fields: dict[str, str],
    *,
    prompt: str = "",
    completion_tokens: list[int] | None = None,
    max_tokens: int | None = None,
) -> list[dict[str, float]]:
    """Reward parts of every completion of one group: batched when the task supports it."""
    batch = getattr(task, "score_group", None)
    if batch is not None:
        return batch(completions, fields, prompt=prompt, completion_tokens=completion_tokens, max_tokens=max_tokens)
    return [task.score(c, fields) for c in completions]


class VerifiedTask:
    """Scores with a list of weighted verifiers (shared.domain.verifiers); prompts come from a subclass."""

    name: str = "verified"
    verifiers: list[Any] = []

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        return self.score_group([completion], fields)[0]

    def score_group(
        self,
        completions: list[str],
        fields: dict[str, str],
        *,
        prompt: str = "",
        completion_tokens: list[int] | None = None,
        max_tokens: int | None = None,
    ) -> list[dict[str, float]]:
        from shared.domain.verifiers import score_components

        return score_components(
            self.verifiers,
            completions,
            fields,
            prompt=prompt,
            completion_tokens=completion_tokens,
            max_tokens=max_tokens,
        )


class ConfiguredTask(VerifiedTask):
    """A job's task: prompts from `inner` (re-templated), rewards from the job's verifiers."""

    def __init__(self, inner: Task, template: str, verifiers: list[Any]) -> None:
        self.inner = inner
        self.name = inner.name
        self.template = template
        self.verifiers = verifiers

    def _render(self, item: TaskItem) -> TaskItem:
        if not self.template:
            return item
        from shared.task_spec import render_template

        prompt = render_template(self.template, {**item.fields, "prompt": item.prompt})
        return TaskItem(item_id=item.item_id, prompt=prompt, fields=item.fields)

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        return (self._render(it) for it in self.inner.train_items(seed))

    def heldout_items(self, n: int) -> list[TaskItem]:
        return [self._render(it) for it in self.inner.heldout_items(n)]

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        if not self.verifiers:  # template only: the inner task still scores
            return self.inner.score(completion, fields)
        return super().score(completion, fields)

    def score_group(self, completions: list[str], fields: dict[str, str], **ctx: Any) -> list[dict[str, float]]:
        if not self.verifiers:
            return score_many(self.inner, completions, fields, **ctx)
        return super().score_group(completions, fields, **ctx)


@lru_cache(maxsize=64)
def _task_for(task: str, verifier: str, spec_json: str) -> Task:
    from shared.domain.tasks.files import FileTask
    from shared.task_spec import TaskSpec, VerifierRef

    ts = TaskSpec.model_validate_json(spec_json)
    if verifier and ts.verifiers:
        raise ValueError("set either `verifier` or `task_spec.verifiers`, not both")
    verifiers = ts.verifiers or ([VerifierRef(name=verifier)] if verifier else [])
    inner: Task = FileTask(task, ts.source) if ts.source is not None else make_task(task, ts.args)
    if not verifiers and not ts.template:
        return inner  # the registered task, unchanged (the arith demo's path)
    return ConfiguredTask(inner, ts.template, verifiers)


def task_for_job(spec: Any) -> Task:
    """The task a job runs (`JobSpec.task` + `verifier` + `task_spec`); cached per configuration."""
    ts = getattr(spec, "task_spec", None)
    task = _task_for(spec.task, spec.verifier, ts.model_dump_json() if ts is not None else "{}")
    # Tasks whose generator runs on user options check a few items under a deadline (rg:<dataset>):
    # here, where the api validates a job and the feeder and rollout build prompts, not in scoring.
    check = getattr(getattr(task, "inner", task), "check_generation", None)
    if check is not None:
        check()
    return task
