"""The environment interface and its registry (pure Python: no torch, no vllm).

An environment turns one task item into an episode of several model turns:
`reset(prompt, fields)` gives the first context text, then each model turn goes to
`step(text)`, which answers with an observation (tool output, game feedback: appended to
the context, never trained on), reward parts and whether the episode is over. The
rollout service drives episodes (services/rollout/episodes.py) and owns the token ids:
an environment only ever sees and returns text.

Plugins are modules named in the rollout service's own settings
(BURSTRL_ROLLOUT_ENV_PLUGINS) that call `register_env` on import. A job payload only
names an environment: it can never make a service import anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.plugins import import_plugins


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    observation: str = ""  # appended to the context (tokenized once; loss-masked)
    reward_parts: dict[str, float] = field(default_factory=dict)  # summed into the episode's parts
    done: bool = False
    answer: str | None = None  # when done: what the task's verifier scores (None: this turn's text)
    tool_call: bool = False  # the turn called a tool (metrics)
    tool_error: bool = False  # ...and the tool failed on it (bad expression, invalid move)


class Env(Protocol):
    name: str
    # Stop strings that end a model turn (a tool call's closing tag). They are kept in the
    # turn's text and token ids, so what the model produced is recorded exactly.
    stop: tuple[str, ...]

    def reset(self, prompt: str, fields: dict[str, str]) -> str:
        """The first context of the episode (usually the task's prompt as is)."""
        ...

    def step(self, text: str) -> StepResult:
        """React to one model turn (its text, stop string included)."""
        ...


EnvFactory = Callable[..., Env]
_ENVS: dict[str, EnvFactory] = {}


class EnvError(ValueError):
    """An environment is unknown or misconfigured: the message says what to fix."""


def register_env(name: str, factory: EnvFactory | None = None, *, replace: bool = False) -> Any:
    """Register `factory(**args) -> Env` under `name`; usable as a decorator."""

    def add(f: EnvFactory) -> EnvFactory:
        if name in _ENVS and _ENVS[name] is not f and not replace:
            raise ValueError(f"environment {name!r} is already registered; pass replace=True to override it")
        _ENVS[name] = f
        return f

    return add(factory) if factory is not None else add


def make_env(name: str, args: dict[str, Any] | None = None) -> Env:
    """A fresh environment instance (one per episode: environments keep episode state)."""
    try:
        factory = _ENVS[name]
    except KeyError:
        raise EnvError(
            f"unknown environment {name!r}; known: {sorted(_ENVS)} "
            "(plugins must be listed in the rollout service's BURSTRL_ROLLOUT_ENV_PLUGINS)"
        ) from None
    try:
        return factory(**(args or {}))
    except TypeError as e:
        raise EnvError(f"environment {name!r} rejected its args {args}: {e}") from e


def env_names() -> list[str]:
    return sorted(_ENVS)


def load_env_plugins(modules: Iterable[str]) -> list[str]:
    """Import each plugin module (they register environments on import)."""
    return import_plugins(modules, setting="BURSTRL_ROLLOUT_ENV_PLUGINS")
