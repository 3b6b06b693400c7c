"""Multi-turn episodes: a policy and an environment taking turns, token-exact.

Turn k is generated from token ids, never from text: the context is the prompt's ids
(tokenized once), then every earlier turn's generated ids exactly as the engine returned
them, then every observation's ids (each observation tokenized once, on its own, and
appended). So what the trainer later sees as prompt + completion is, token for token,
what the sampler saw and produced; there is no re-tokenization drift between turns.

The episode's completion after the prompt interleaves
- generated tokens: loss_mask 1, the sampler's log-probs;
- observation tokens (tool output, game feedback): loss_mask 0, log-prob 0 (never trained on).
Its `text` is the final answer the environment hands to the task's verifier; its
`reward_parts` carry the environment's reward parts and, when the episode did not end
normally, a zero-valued tag "env!<reason>" (max_turns, max_tokens, context, wall_time,
timeout, error:<Exception>). Its `turn_starts` / `turn_rewards` say where each model turn
starts in the token ids and what the environment's step paid for it (tags excluded), so the
trainer can give each turn its own advantage.

Limits per episode: model turns, tokens after the prompt (generated + observations),
wall time, and a deadline on each reset/step call. Environment code runs in daemon threads
joined with a deadline: an exception or a hang ends that episode, never the service. A
step that never returns leaks its thread (counted by `stuck_env_calls`; the rollout
service reports it in /readyz): environments whose steps can spin forever in Python should
do that work in a subprocess (as the code sandbox does).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.rollout.engine import Adapter, Engine, SamplingConfig
from services.rollout.errors import RequestFailed
from shared.domain.envs import Env, EnvSpec, StepResult, make_env
from shared.domain.verifiers import TAG_SEP, split_parts
from shared.schema import Completion, pack_f32, pack_i32, pack_u8

_TIMEOUT = object()
_stuck_lock = threading.Lock()
_stuck = 0  # env calls that missed their deadline and whose threads are still running


def stuck_env_calls() -> int:
    """Environment calls abandoned after their deadline that have not returned (yet)."""
    with _stuck_lock:
        return _stuck


def call_all(calls: list[tuple[Callable[[], Any], float]]) -> list[Any]:
    """Run (fn, timeout_s) calls concurrently; each result, its exception, or _TIMEOUT.

    Daemon threads, one per call: a call that hangs is abandoned (it cannot be killed from
    Python) and cannot keep the process from exiting.
    """
    results: list[Any] = [_TIMEOUT] * len(calls)

    def run(i: int, fn: Callable[[], Any]) -> None:
        global _stuck
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - an env's failure is data here, not ours
            results[i] = e
        if done[i].is_set():  # it had been abandoned: it returned after all
            with _stuck_lock:
                _stuck -= 1

    done = [threading.Event() for _ in calls]
    threads = [
        threading.Thread(target=run, args=(i, fn), daemon=True, name="env-call") for i, (fn, _) in enumerate(calls)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    out = []
    for i, (t, (_, timeout)) in enumerate(zip(threads, calls, strict=True)):
        t.join(max(0.0, t0 + timeout - time.monotonic()))
        if t.is_alive():
            global _stuck
            with _stuck_lock:
                # Mark under the lock, so a thread finishing right now decrements only if counted.
                done[i].set()
                _stuck += 1
            out.append(_TIMEOUT)
        else:
            out.append(results[i])
    return out


@dataclass
class Episode:
    """One episode's state; after `run_episodes`, its trajectory and why it ended."""

    env: Env
    prompt: str
    fields: dict[str, str]
    adapter: Adapter | None
    cfg: SamplingConfig  # per turn: n=1, the job's and the environment's stop strings, kept in the output
    limits: EnvSpec
    context: int  # the engine's context length: prompt + trajectory + next turn must fit
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # index in `ids` where each model turn starts
    turn_rewards: list[float] = field(default_factory=list)  # each model turn's step reward (tags excluded)
    parts: dict[str, float] = field(default_factory=dict)
    answer: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end: str = ""  # "" while running; then "done" or the reason it was cut short
    finish_reason: str = "stop"
    t0: float = field(default_factory=time.monotonic)

    @property
    def generated_tokens(self) -> int:
        return sum(self.mask)

    def _finish(self, reason: str) -> None:
        self.end = reason
        if reason in ("max_tokens", "context"):
            self.finish_reason = "length"
        if reason.startswith(("error", "timeout")):
            # The environment failed, not the policy: keep the episode (the ledger and the
            # group stay whole) but let none of its tokens carry gradient.
            self.mask = [0] * len(self.mask)

    def budget(self) -> int:
        """Tokens the next turn may generate under the token and context limits."""
        return min(self.limits.max_tokens - len(self.ids), self.context - len(self.prompt_ids) - len(self.ids) - 1)

    def completion(self) -> Completion:
        parts = dict(self.parts)
        if self.end != "done":
            parts[f"env{TAG_SEP}{self.end}"] = 0.0
        return Completion(
            token_ids=pack_i32(self.ids),
            logprobs=pack_f32(self.logprobs),
            loss_mask=pack_u8(self.mask),
            text=self.answer,
            finish_reason=self.finish_reason,
            reward_parts=parts,
            turn_starts=pack_i32(self.turn_starts),
            turn_rewards=pack_f32(self.turn_rewards),
        )


def new_episode(
    spec: Any, prompt: str, fields: dict[str, str], adapter: Adapter | None, cfg: SamplingConfig, context: int
) -> Episode:
    """An episode of `spec.env` (a JobSpec) on one prompt; raises EnvError for an unknown env."""
    env = make_env(spec.env.name, dict(spec.env.args))
    turn_cfg = dataclasses.replace(cfg, n=1, stop=tuple(dict.fromkeys((*cfg.stop, *env.stop))), include_stop=True)
    return Episode(env, prompt, dict(fields), adapter, turn_cfg, spec.env, context)


def _error(e: object) -> str | None:
    if e is _TIMEOUT:
        return "timeout"
    if isinstance(e, BaseException):
        return f"error:{type(e).__name__}"
    return None


def run_episodes(engine: Engine, episodes: list[Episode]) -> None:
    """Run every episode to its end, turn by turn, batching each turn into engine calls.

    EngineUnavailable propagates (the caller leaves its entries pending), and so does
    RequestFailed, its `index` the failed episode's position in `episodes`; environment
    failures end only their own episode.
    """
    if not episodes:
        return
    position = {id(e): i for i, e in enumerate(episodes)}
    # reset -> first context, tokenized once per distinct text (a group shares its prompt)
    firsts = call_all([(lambda e=e: e.env.reset(e.prompt, e.fields), e.limits.step_timeout_s) for e in episodes])
    cache: dict[str, list[int]] = {}
    for e, first in zip(episodes, firsts, strict=True):
        e.t0 = time.monotonic()
        if (err := _error(first)) is not None or not isinstance(first, str):
            # The prompt as given stands in, so the group keeps one prompt (and this episode
            # an empty, untrained completion).
            e._finish(err or "error:bad_reset")
            first = e.prompt
        if first not in cache:
            cache[first] = engine.tokenize(first, special=True)
        e.prompt_ids = list(cache[first])
        if not e.end and e.budget() <= 0:
            e._finish("context")

    while True:
        active = [e for e in episodes if not e.end]
        for e in active:
            if time.monotonic() - e.t0 > e.limits.max_seconds:
                e._finish("wall_time")
            elif e.budget() <= 0:
                e._finish("max_tokens" if e.limits.max_tokens - len(e.ids) <= 0 else "context")
        active = [e for e in episodes if not e.end]
        if not active:
            return
        # One engine call per sampling config (jobs differ); episodes whose budget is below
        # the turn cap are cut to it afterwards: a prefix of a sample is a valid sample.
        by_cfg: dict[SamplingConfig, list[Episode]] = {}
        for e in active:
            by_cfg.setdefault(e.cfg, []).append(e)
        for cfg, group in by_cfg.items():
            turn_cfg = dataclasses.replace(cfg, max_tokens=max(1, min(cfg.max_tokens, max(e.budget() for e in group))))
            try:
                gens = engine.generate_ids([e.prompt_ids + e.ids for e in group], [e.adapter for e in group], turn_cfg)
            except RequestFailed as err:
                err.index = None if err.index is None else position[id(group[err.index])]
                raise
            for e, g in zip(group, gens, strict=True):
                s = g.samples[0]
                budget = e.budget()
                keep = min(len(s.token_ids), budget)
                # Cut by the episode's budget (not the turn cap): the turn is unfinished, no answer.
                over = keep < len(s.token_ids) or (s.finish_reason == "length" and budget <= keep < cfg.max_tokens)
                e.turn_starts.append(len(e.ids))
                e.turn_rewards.append(0.0)  # a turn cut short, or whose step fails, earns nothing
                e.ids += list(s.token_ids[:keep])
                e.logprobs += list(s.logprobs[:keep])
                e.mask += [1] * keep
                e.turns += 1
                e.finish_reason = s.finish_reason
                if over:
                    e._finish("max_tokens" if e.limits.max_tokens - len(e.ids) <= 0 else "context")
                else:
                    e._text = s.text  # type: ignore[attr-defined]
        stepping = [e for e in active if not e.end]
        steps = call_all([(lambda e=e: e.env.step(e._text), e.limits.step_timeout_s) for e in stepping])  # type: ignore[attr-defined]
        for e, r in zip(stepping, steps, strict=True):
            text = e.__dict__.pop("_text")
            if (err := _error(r)) is not None or not isinstance(r, StepResult):
                e._finish(err or "error:bad_step_result")
                continue
            try:
                step_parts = {str(k): float(v) for k, v in r.reward_parts.items()}
            except (TypeError, ValueError, AttributeError):
                e._finish("error:bad_reward_parts")
                continue
            for k, v in step_parts.items():
                e.parts[k] = e.parts.get(k, 0.0) + v
            # The turn's own reward, for per-turn credit: its parts' values, tags ("x!reason")
            # left out as the reward stage's split_parts does (they are zero-valued markers).
            e.turn_rewards[-1] = sum(split_parts(step_parts)[0].values())
            e.tool_calls += int(bool(r.tool_call))
            e.tool_errors += int(bool(r.tool_error))
            if r.done:
                e.answer = text if r.answer is None else str(r.answer)
                e._finish("done")
                continue
            if e.turns >= e.limits.max_turns:
                e._finish("max_turns")
                continue
            obs = engine.tokenize(str(r.observation), special=False) if r.observation else []
            if len(obs) > e.budget() - 1:  # room for the observation and at least one more token
                e._finish("max_tokens" if len(e.ids) + len(obs) >= e.limits.max_tokens else "context")
                continue
            e.ids += obs
            e.logprobs += [0.0] * len(obs)
            e.mask += [0] * len(obs)


def episode_stats(episodes: list[Episode]) -> dict[str, Any]:
    """Per-job metrics of a set of episodes (the "rollout_env" metrics point)."""
    n = max(1, len(episodes))
    ends: dict[str, int] = {}
    for e in episodes:
        ends[e.end] = ends.get(e.end, 0) + 1
    return {
        "episodes": len(episodes),
        "turns_mean": sum(e.turns for e in episodes) / n,
        "tool_calls": sum(e.tool_calls for e in episodes),
        "tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "tool_errors": sum(e.tool_errors for e in episodes),
        "length_mean": sum(len(e.ids) for e in episodes) / n,  # tokens after the prompt
        "generated_mean": sum(e.generated_tokens for e in episodes) / n,
        "ends": ends,
        "stuck_env_calls": stuck_env_calls(),
    }
