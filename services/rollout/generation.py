"""Generation rounds: prompts from the bus -> G completions each -> groups on the bus.

One engine call per sampling config: jobs differ in G and sampling settings, and jobs with
the same config share a call (vLLM batches their adapters side by side). Multi-turn (env)
jobs run as episodes, apart from single-turn ones. Each group is tagged with the version
its prompt was leased to (services/rollout/served.py).

A prompt whose request the engine refuses, or answers without a log-prob, produces no
group: it stays pending and is redone, and after the bus's max deliveries it is
dead-lettered with the reason (the other prompts of its call are produced as usual).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import Counter, Gauge

from services.rollout.engine import Generation, SamplingConfig
from services.rollout.episodes import Episode, episode_stats, stuck_env_calls
from services.rollout.errors import RequestFailed
from services.rollout.served import Leases, ServedJob, ServedVersion, sampling_of
from services.rollout.settings import RolloutSettings
from shared import keys
from shared.bus import Bus, Entry
from shared.domain.envs import EnvError
from shared.job import JobState
from shared.metrics import record_point
from shared.schema import Completion, GroupMsg, PromptMsg, encode, pack_f32, pack_i32, pack_u8
from shared.service import ServiceRuntime

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
Todo = tuple[Entry, PromptMsg, ServedJob]
Unit = tuple[Entry, list[tuple[str, bytes]], dict[str, int]]


def isolate(items: list[T], call: Callable[[list[T]], list[R]]) -> list[R | RequestFailed]:
    """`call(items)`, item by item in order; an item whose request failed gets its
    RequestFailed and the others are called again without it (halves, when the engine did not
    say which): one bad prompt never costs its neighbours their groups."""
    if not items:
        return []
    try:
        return list(call(items))
    except RequestFailed as err:
        if len(items) == 1:
            return [err]
        i = err.index
        if i is not None and 0 <= i < len(items):
            rest = isolate(items[:i] + items[i + 1 :], call)
            return [*rest[:i], err, *rest[i:]]
        mid = len(items) // 2
        return isolate(items[:mid], call) + isolate(items[mid:], call)


class Generator:
    def __init__(
        self,
        rt: ServiceRuntime,
        settings: RolloutSettings,
        bus: Bus,
        leases: Leases,
        adopt: Callable[[ServedJob], None],
    ) -> None:
        self.rt, self.s, self.bus, self.leases, self.adopt = rt, settings, bus, leases, adopt
        reg = rt.registry
        self.m_tokens = Counter("burstrl_rollout_tokens", "Completion tokens generated", registry=reg)
        self.m_groups = Counter("burstrl_rollout_groups", "Groups produced", registry=reg)
        self.m_tps = Gauge("burstrl_rollout_tokens_per_second", "Generated tokens/s (last window)", registry=reg)
        self.m_idle = Gauge("burstrl_rollout_idle_fraction", "Wall time not in the engine (last window)", registry=reg)
        self.idle_frac = 0.0  # the same, for the metric points
        self.m_env_turns = Counter("burstrl_rollout_env_turns", "Model turns in env episodes", registry=reg)
        self.m_env_tools = Counter("burstrl_rollout_env_tool_calls", "Tool calls in env episodes", registry=reg)
        self.m_env_tool_err = Counter("burstrl_rollout_env_tool_errors", "Failed tool calls", registry=reg)
        self.m_env_ends = Counter("burstrl_rollout_env_episodes", "Env episodes by end", ["end"], registry=reg)
        self._win_t0, self._win_busy0, self._win_tokens = time.time(), leases.busy_s, 0

    def generate_once(self, jobs: dict[str, ServedJob], *, block_ms: int = 500) -> None:
        """One engine round over the served jobs' prompts; a metrics point per job."""
        t0 = time.time()
        running = {j: v for j, v in jobs.items() if v.rec.state == JobState.running}
        entries = self.bus.read([keys.prompts(j) for j in running], count=self.s.prompts_per_batch, block_ms=block_ms)
        if not entries:
            return
        # The feeder tops prompts up right after the trainer acknowledges a step, i.e. just
        # after it published a version: adopt that version before generating, or the batch
        # is sampled a version behind and the trainer may drop it as stale (the demo lost
        # ~28% of its groups this way).
        for job_id in sorted({e.job_id for e in entries} & set(running)):
            self.adopt(running[job_id])
        by_cfg: dict[tuple[SamplingConfig, bool], list[Todo]] = {}
        for e, msg in self.bus.decode(entries, PromptMsg):
            view = running.get(e.job_id)
            if view is None:
                self.bus.dead_letter(e, "job is not served by this rollout pool")
                continue
            spec = view.rec.spec
            by_cfg.setdefault((sampling_of(spec), bool(spec.env.name)), []).append((e, msg, view))
        stats: dict[str, dict[str, float]] = {}
        episodes: dict[str, list[Episode]] = {}
        try:
            for (cfg, multi), batch in by_cfg.items():
                units = self._episodes(batch, cfg, stats, episodes) if multi else self._groups(batch, cfg, stats)
                # Settled in one pipelined round trip per batch (each group still atomically and at
                # most once): a round trip per group cost ~15% of tokens/s on a small model.
                for (e, _, _), settled in zip(units, self.bus.settle_each(units), strict=True):
                    if settled:  # handed on now: a group another replica already handed on is not ours
                        self.m_groups.inc()
                    else:
                        stats[e.job_id]["groups"] -= 1
        finally:  # an engine outage mid-round: what was produced is still reported
            self._record(jobs, stats, episodes, round(time.time() - t0, 3))

    # -- single-turn -----------------------------------------------------------------
    def _groups(self, batch: list[Todo], cfg: SamplingConfig, stats: dict) -> list[Unit]:
        def call(part: list[Todo]) -> list[tuple[ServedVersion, Generation]]:
            return self.leases.generate([(m.prompt, v) for _, m, v in part], cfg)

        now = time.time()
        units: list[Unit] = []
        for e, msg, (loaded, gen) in self._produced(batch, isolate(batch, call)):
            group = GroupMsg(
                job_id=msg.job_id,
                group_id=msg.group_id,
                item_id=msg.item_id,
                prompt=msg.prompt,
                prompt_ids=pack_i32(gen.prompt_ids),
                fields=msg.fields,
                policy_version=loaded.version,  # the version it was submitted on
                sampled_at=now,
                completions=[
                    Completion(
                        token_ids=pack_i32(s.token_ids),
                        logprobs=pack_f32(s.logprobs),
                        loss_mask=pack_u8([1] * len(s.token_ids)),
                        text=s.text,
                        finish_reason=s.finish_reason,
                    )
                    for s in gen.samples
                ],
            )
            units.append((e, [(keys.rollouts(msg.job_id), encode(group))], {"produced": 1}))
            tokens = [len(s.token_ids) for s in gen.samples]
            self._count(stats, msg.job_id, tokens, [s.finish_reason for s in gen.samples])
        return units

    # -- multi-turn ------------------------------------------------------------------
    def _episodes(
        self, batch: list[Todo], cfg: SamplingConfig, stats: dict, episodes: dict[str, list[Episode]]
    ) -> list[Unit]:
        batch = self._valid_envs(batch, cfg)

        def call(part: list[Todo]) -> list[tuple[ServedVersion, list[Episode]]]:
            return self.leases.episodes([(m.prompt, dict(m.fields), v) for _, m, v in part], cfg, cfg.n)

        results = isolate(batch, call)
        stuck = stuck_env_calls()
        if stuck >= self.s.max_stuck_env_calls:
            self.rt.health.set("env", False, f"{stuck} environment calls hang past their deadline; restart rollout")
        else:
            self.rt.health.set("env", True)
        now = time.time()
        units: list[Unit] = []
        for e, msg, (loaded, eps) in self._produced(batch, results):
            for ep in eps:
                self.m_env_turns.inc(ep.turns)
                self.m_env_tools.inc(ep.tool_calls)
                self.m_env_tool_err.inc(ep.tool_errors)
                self.m_env_ends.labels(ep.end).inc()
            units.append((e, [(keys.rollouts(msg.job_id), encode(env_group(msg, loaded, eps, now)))], {"produced": 1}))
            episodes.setdefault(msg.job_id, []).extend(eps)
            self._count(stats, msg.job_id, [ep.generated_tokens for ep in eps], [ep.finish_reason for ep in eps])
        return units

    def _valid_envs(self, batch: list[Todo], cfg: SamplingConfig) -> list[Todo]:
        """The entries whose job's environment can be made; the others are the job's config
        error (an unknown env, bad args), not the service's: dead-lettered with the reason."""
        bad: dict[str, str] = {}
        for job_id, view in {v.id: v for _, _, v in batch}.items():
            try:
                self.leases.new_episodes("", {}, view.rec.spec, cfg, 1)
            except EnvError as err:
                bad[job_id] = f"environment: {err}"
        for e, _, view in batch:
            if view.id in bad:
                self.bus.dead_letter(e, bad[view.id])
        return [t for t in batch if t[2].id not in bad]

    # -- bookkeeping -----------------------------------------------------------------
    def _produced(self, batch: list[Todo], results: list[R | RequestFailed]) -> Iterator[tuple[Entry, PromptMsg, R]]:
        """The (entry, prompt, result) of each prompt that has a result. One whose request
        failed has no group: it is redone (it stays pending) or, after max deliveries,
        dead-lettered with the reason."""
        for (e, msg, _), res in zip(batch, results, strict=True):
            if not isinstance(res, RequestFailed):
                yield e, msg, res
                continue
            reason = f"engine: {type(res).__name__}: {res}"
            if not self.bus.redo_or_dead_letter(e, reason):
                log.warning("job %s: prompt %s produced no group (%s); it will be redone", e.job_id, e.id, reason)

    def _count(self, stats: dict, job_id: str, tokens: list[int], finish: list[str]) -> None:
        n = sum(tokens)
        self.m_tokens.inc(n)
        self._win_tokens += n
        st = stats.setdefault(job_id, {"groups": 0, "tokens": 0, "samples": 0, "truncated": 0})
        st["groups"] += 1
        st["tokens"] += n
        st["samples"] += len(tokens)
        st["truncated"] += sum(f == "length" for f in finish)

    def _record(
        self, jobs: dict[str, ServedJob], stats: dict, episodes: dict[str, list[Episode]], seconds: float
    ) -> None:
        for job_id, st in stats.items():
            version = jobs[job_id].version if job_id in jobs else None
            point = {
                "groups": st["groups"],
                "seconds": seconds,
                "tokens": st["tokens"],
                "tokens_per_s": round(st["tokens"] / seconds, 1) if seconds > 0 else 0.0,
                "truncated_frac": round(st["truncated"] / max(1, st["samples"]), 4),
                "version": version,
                # The engine's idle share over the last ~10 s window (all jobs): what "never idle" measures.
                "idle_frac": round(self.idle_frac, 4),
            }
            record_point(self.rt.redis, job_id, "rollout", point)
            if job_id in episodes:  # turns, tool calls and errors, episode length
                record_point(
                    self.rt.redis, job_id, "rollout_env", {**episode_stats(episodes[job_id]), "version": version}
                )

    def window(self) -> None:
        """Tokens/s and idle fraction over ~10 s windows (Prometheus also has rate() of the counters)."""
        elapsed = time.time() - self._win_t0
        if elapsed < 10:
            return
        self.m_tps.set(self._win_tokens / elapsed)
        self.idle_frac = max(0.0, 1.0 - (self.leases.busy_s - self._win_busy0) / elapsed)
        self.m_idle.set(self.idle_frac)
        self._win_t0, self._win_busy0, self._win_tokens = time.time(), self.leases.busy_s, 0


def env_group(msg: PromptMsg, loaded: ServedVersion, eps: list[Episode], now: float) -> GroupMsg:
    """One group of episodes; they share the prompt's token ids (the trainer's prompt)."""
    prompt_ids = eps[0].prompt_ids
    completions = []
    for ep in eps:
        if ep.prompt_ids != prompt_ids:
            # An environment whose reset text differs between episodes of one group cannot
            # share the group's prompt: keep the episode, empty and untrained.
            ep.ids, ep.logprobs, ep.mask, ep.answer = [], [], [], ""
            ep.end = "error:prompt_mismatch"
        completions.append(ep.completion())
    return GroupMsg(
        job_id=msg.job_id,
        group_id=msg.group_id,
        item_id=msg.item_id,
        prompt=msg.prompt,
        prompt_ids=pack_i32(prompt_ids),
        fields=msg.fields,
        policy_version=loaded.version,
        sampled_at=now,
        completions=completions,
    )
