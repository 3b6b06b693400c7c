"""What an agent episode holds, and the helpers that turn it into a group's completion
(services/rollout/agents.py serves them; docs/agents.md).

An episode's token ids are the record: its first context, then each turn's generated ids
(loss mask 1, the sampler's log-probs) and the appended ids of the messages after it (mask 0).
A group is `group_size` episodes of one task; a Turn is one engine call a handler waits for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from services.rollout.engine import SamplingConfig
from services.rollout.served import ServedVersion
from shared.schema import Completion, pack_f32, pack_i32, pack_u8


class AgentError(Exception):
    """A refused agent request: its HTTP status and the reason."""

    def __init__(self, status: int, reason: str, detail: object = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.detail = detail  # a structured detail (a 422's field errors), else the reason


@dataclass
class AgentEpisode:
    id: str
    group: AgentGroup
    mode: str = ""  # "chat" or "completion", fixed by its first call
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: the history it holds (normalized)
    tools: list[dict[str, Any]] | None = None
    text: str = ""  # completion: the prompt text so far, as the client sees it
    prompt_ids: list[int] = field(default_factory=list)  # the first call's context
    ids: list[int] = field(default_factory=list)  # after the prompt: generated (mask 1) and appended (mask 0)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    last_generated: list[int] = field(default_factory=list)
    answer: str = ""  # the last assistant turn's content (what a verifier scores)
    finish_reason: str = "stop"
    turns: int = 0
    busy: bool = False  # a call is in progress: a second one at once would fork the history
    closed: str = ""  # "" open; "reward" or "verify"
    reward_parts: dict[str, float] = field(default_factory=dict)

    def completion(self, skip: int) -> Completion:
        """Its trajectory after the group's shared prompt (`skip` ids of its own prompt)."""
        extra = self.prompt_ids[skip:]
        return Completion(
            token_ids=pack_i32(extra + self.ids),
            logprobs=pack_f32([0.0] * len(extra) + self.logprobs),
            loss_mask=pack_u8([0] * len(extra) + self.mask),
            text=self.answer,
            finish_reason=self.finish_reason,
            reward=sum(self.reward_parts.values()) if self.closed == "reward" else 0.0,
            reward_parts=dict(self.reward_parts),
            turn_starts=pack_i32([len(extra) + t for t in self.turn_starts]),
            turn_rewards=pack_f32([0.0] * len(self.turn_starts)),
        )


@dataclass
class AgentGroup:
    id: str
    job_id: str
    fields: dict[str, str]
    deadline_at: float  # wall clock
    episodes: list[AgentEpisode] = field(default_factory=list)
    lease: ServedVersion | None = None  # taken by the worker at the group's first turn
    sampled_at: float = 0.0
    ended: str = ""  # "" open; "bus" or "dropped_<reason>" once it left (the worker then frees the lease)


@dataclass
class Turn:
    """One engine call an HTTP handler waits for."""

    episode: AgentEpisode
    context: list[int]
    cfg: SamplingConfig
    done: threading.Event = field(default_factory=threading.Event)
    sample: Any = None
    version: int = -1
    error: AgentError | None = None


def strip_stop(text: str, stop: tuple[str, ...], finish: str) -> str:
    """The reply's text without the stop string that ended it (OpenAI semantics); the ids keep it."""
    if finish != "length":
        for s in stop:
            if s and text.endswith(s):
                return text[: -len(s)]
    return text


def usage(turn: Turn) -> dict[str, int]:
    n = len(turn.sample.token_ids)
    return {"prompt_tokens": len(turn.context), "completion_tokens": n, "total_tokens": len(turn.context) + n}


def common_prefix(seqs: list[list[int]]) -> int:
    """Length of the ids every episode's prompt starts with (the group's shared prompt)."""
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return i
    return n


def prompt_text(ep: AgentEpisode) -> str:
    if ep.mode == "chat" and ep.messages:
        users = [m["content"] for m in ep.messages if m["role"] == "user"]
        return users[0] if users else ep.messages[0]["content"]
    return ep.text[:4096]
