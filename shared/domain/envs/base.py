"""The environment interface and its registry (pure Python: no torch, no vllm).

An environment turns one task item into an episode of several model turns:
`reset(prompt, fields)` gives the first context text, then each model turn goes to
`step(text)`, which answers with an observation (tool output, game feedback: appended to
the context, never trained on), reward parts and whether the episode is over. The
rollout service drives episodes (services/rollout/episodes.py) and owns the token ids:
an environment only ever sees and returns text.

The built-ins are named in shared/domain/catalog.py and loaded on first use. Plugins are
modules named in the rollout service's own settings (BURSTRL_ROLLOUT_ENV_PLUGINS) that call
`register_env` on import. A job payload only names an environment: it can never make a
service import anything.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.domain import catalog
from shared.plugins import Registry, import_plugins


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


class EnvError(ValueError):
    """An environment is unknown or misconfigured: the message says what to fix."""


class ToolEnv:
    """The tool-use episode the built-in tools share (subclasses implement `call`).

    A model turn containing OPEN...CLOSE calls the tool with what is between (the first
    call of the turn; the turn ends at CLOSE, a stop string). A turn without a call is
    the final answer; with `submit_last_result`, an empty final turn (just EOS) submits the
    last successful tool result instead ("return what the tool said"). More than
    `max_calls` calls end the episode unanswered: a policy must not loop on the tool.
    `tool_error_penalty` > 0 puts the reward part {"tool_error": -penalty} on each turn
    whose call failed: a step reward that per-turn advantages (algorithm.advantage_level
    = "turn") credit to that very turn; 0 pays nothing per step.
    """

    name = "tool"

    def __init__(
        self,
        open_tag: str,
        close_tag: str,
        *,
        max_calls: int = 3,
        submit_last_result: bool = True,
        tool_error_penalty: float = 0.0,
    ) -> None:
        if not isinstance(tool_error_penalty, int | float) or not 0.0 <= tool_error_penalty <= 100.0:
            raise EnvError(f"{self.name}: tool_error_penalty must be a number in [0, 100], got {tool_error_penalty!r}")
        if not isinstance(max_calls, int) or not 0 <= max_calls <= 64:
            raise EnvError(f"{self.name}: max_calls must be an integer in [0, 64], got {max_calls!r}")
        self.stop = (close_tag,)
        self._call = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
        self.max_calls = max_calls
        self.submit_last_result = submit_last_result
        self.tool_error_penalty = float(tool_error_penalty)
        self.calls = 0
        self.last: str | None = None  # the last successful tool result

    def reset(self, prompt: str, fields: dict[str, str]) -> str:
        self.calls, self.last = 0, None
        return prompt

    def step(self, text: str) -> StepResult:
        m = self._call.search(text)
        if m is None:
            if self.submit_last_result and not text.strip() and self.last is not None:
                return StepResult(done=True, answer=self.last)
            return StepResult(done=True, answer=text)
        self.calls += 1
        if self.calls > self.max_calls:
            return StepResult(done=True, answer="", tool_call=True, tool_error=True, reward_parts=self._penalty())
        return self.call(m.group(1))

    def call(self, arg: str) -> StepResult:
        """Run the tool on one call's text: `self.result(...)` or `self.failed(...)`."""
        raise NotImplementedError

    def result(self, value: str, observation: str) -> StepResult:
        self.last = value
        return StepResult(observation=observation, tool_call=True)

    def failed(self, observation: str) -> StepResult:
        return StepResult(observation=observation, tool_call=True, tool_error=True, reward_parts=self._penalty())

    def _penalty(self) -> dict[str, float]:
        # No part at all when off: the episode's parts (and the reward metrics) stay as before.
        return {"tool_error": -self.tool_error_penalty} if self.tool_error_penalty > 0.0 else {}


EnvFactory = Callable[..., Env]
_ENVS: Registry[EnvFactory] = Registry("environment", catalog.ENVS)


def register_env(name: str, factory: EnvFactory | None = None, *, replace: bool = False) -> Any:
    """Register `factory(**args) -> Env` under `name`; usable as a decorator."""
    return _ENVS.register(name, factory, replace=replace)


def make_env(name: str, args: dict[str, Any] | None = None) -> Env:
    """A fresh environment instance (one per episode: environments keep episode state)."""
    factory = _ENVS.get(name)
    if factory is None:
        raise EnvError(
            f"unknown environment {name!r}; known: {_ENVS.names()} "
            "(plugins must be listed in the rollout service's BURSTRL_ROLLOUT_ENV_PLUGINS)"
        )
    try:
        return factory(**(args or {}))
    except TypeError as e:
        raise EnvError(f"environment {name!r} rejected its args {args}: {e}") from e


def env_names() -> list[str]:
    return _ENVS.names()


def load_env_plugins(modules: Iterable[str]) -> list[str]:
    """Import each plugin module (they register environments on import)."""
    return import_plugins(modules, setting="BURSTRL_ROLLOUT_ENV_PLUGINS")
