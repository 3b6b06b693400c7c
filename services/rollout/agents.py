"""Agent episodes: groups an agent drives through the OpenAI-compatible endpoint (docs/agents.md).

An agent opens a group of `group_size` episodes of one task (`open_group`), drives each
episode through chat or completion calls (`turn`), and closes each with a reward or hands
it to the job's verifiers (`close`). Once every episode of the group is closed the group
enters the bus as any group does: a rewarded group goes to the stage after reward (scored,
or ready when the job has no ref stage), a verified one to the reward stage. A group with
an episode still open at its deadline (agent.deadline_s) is dropped, counted fed and
dropped_agent_deadline. Both go through `shared.bus.inject`, once per group id, so the
ledger balances (docs/architecture.md, invariant 3) however often a client retries.

Threads: HTTP handlers render messages and wait; the engine and the leases belong to the
worker's loop, which runs the queued turns in `step()` (vLLM wants one thread). A group
takes its lease on the job's current version at its first turn and holds it until it
leaves: every turn of every episode of a group runs on one version, the version its
GroupMsg carries (invariant 6), and the trainer judges its staleness like any group's.

Episodes live in this replica's memory: its token ids are what makes turns exact
(services/rollout/chat.py). A rollout restart loses its open groups; they were never
counted, so the ledger stays balanced, and the agent gets 404 for them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import Any

from prometheus_client import Counter, Gauge

from services.rollout.agent_episodes import (
    AgentEpisode,
    AgentError,
    AgentGroup,
    Turn,
    common_prefix,
    prompt_text,
    strip_stop,
    usage,
)
from services.rollout.chat import ChatError, ChatTemplate, HistoryMismatch, check_extends, normal, parse_tool_calls
from services.rollout.engine import SamplingConfig
from services.rollout.errors import EngineUnavailable, RequestFailed
from services.rollout.served import Leases, ServedJob, sampling_of
from shared import keys
from shared.backlog import feed_room
from shared.bus import inject
from shared.job import JobState
from shared.ledger import UnknownJob
from shared.limits import AGENT_OPEN_EPISODES_MAX
from shared.metrics import read_ledger, record_point
from shared.schema import GroupMsg, encode, pack_i32
from shared.service import ServiceRuntime

log = logging.getLogger(__name__)
TURN_WAIT_S = 600.0  # a handler waits this long for its turn (an evaluation round may run first)


class AgentServer:
    """Open agent groups of the jobs this replica serves, and the turns waiting for the engine."""

    def __init__(self, rt: ServiceRuntime, model: str, leases: Leases, jobs: dict[str, ServedJob]) -> None:
        self.rt, self.model, self.leases, self.jobs = rt, model, leases, jobs
        self.groups: dict[str, AgentGroup] = {}
        self.episodes: dict[str, AgentEpisode] = {}
        self.lock = threading.Lock()
        self.turns: queue.Queue[Turn] = queue.Queue()
        self._template: ChatTemplate | None = None
        self._template_error = ""
        reg = rt.registry
        self.m_open = Gauge("burstrl_agent_open_groups", "Agent groups open on this replica", registry=reg)
        self.m_turns = Counter("burstrl_agent_turns", "Agent model turns generated", registry=reg)
        self.m_groups = Counter("burstrl_agent_groups", "Agent groups that left, by outcome", ["outcome"], registry=reg)

    # -- the chat template (loaded on first use: completion-only agents never need it) --
    def template(self) -> ChatTemplate:
        if self._template is None and not self._template_error:
            try:
                self._template = ChatTemplate(self.model)
            except Exception as e:  # noqa: BLE001 - no tokenizer or template: said on every chat call
                self._template_error = f"chat unavailable for base model {self.model}: {type(e).__name__}: {e}"
        if self._template is None:
            raise AgentError(409, self._template_error)
        return self._template

    @property
    def active(self) -> bool:
        return bool(self.groups)

    # -- HTTP side -----------------------------------------------------------------
    def served(self, job_id: str) -> ServedJob:
        """The job, if this replica may run turns of it now; else AgentError with the reason."""
        view = self.jobs.get(job_id)
        if view is None:
            raise AgentError(
                404, f"job {job_id!r} is not served by this rollout replica (unknown, ended, or another base model)"
            )
        rec = view.rec
        if not rec.spec.agent.enabled:
            raise AgentError(
                409, f"job {job_id} is not an agent job: its prompts come from its task (set agent.enabled = true)"
            )
        if rec.state != JobState.running:
            raise AgentError(409, f"job {job_id} is {rec.state.value}, not running: no turns are generated for it")
        return view

    def open_group(self, job_id: str, fields: dict[str, str]) -> AgentGroup:
        view = self.served(job_id)
        spec = view.rec.spec
        # Invariant 4 for agents: groups in flight (on the bus, and open here) stay within the
        # job's window, as the feeder keeps prompts within it; beyond, they would only be
        # dropped as stale. (Groups open on other replicas are not seen here.)
        room, why = feed_room(self.rt.redis, view.rec, read_ledger(self.rt.redis, job_id))
        open_here = sum(1 for g in self.groups.values() if g.job_id == job_id and not g.ended)
        if room - open_here <= 0:
            raise AgentError(
                429,
                f"job {job_id}: {why or 'in-flight window full'} ({open_here} groups open here, window "
                f"{spec.inflight_window} = (max_staleness + 1) x batch_size); retry after the trainer's next step",
            )
        with self.lock:
            if len(self.episodes) + spec.group_size > AGENT_OPEN_EPISODES_MAX:
                raise AgentError(
                    429, f"this replica holds {len(self.episodes)} open episodes (at most {AGENT_OPEN_EPISODES_MAX})"
                )
            g = AgentGroup(
                f"{job_id}:a{uuid.uuid4().hex[:16]}", job_id, dict(fields), time.time() + spec.agent.deadline_s
            )
            g.episodes = [AgentEpisode(uuid.uuid4().hex, g) for _ in range(spec.group_size)]
            self.groups[g.id] = g
            for ep in g.episodes:
                self.episodes[ep.id] = ep
        self.m_open.set(len(self.groups))
        return g

    def episode(self, job_id: str, episode_id: str) -> AgentEpisode:
        ep = self.episodes.get(episode_id)
        if ep is None or ep.group.job_id != job_id:
            raise AgentError(
                404,
                f"no open episode {episode_id!r} of job {job_id} on this replica (closed, dropped, or rollout restarted)",
            )
        if ep.group.ended:
            raise AgentError(409, f"episode {episode_id}'s group has left: {ep.group.ended}")
        return ep

    def chat(self, job_id: str, episode_id: str, req: dict[str, Any]) -> dict[str, Any]:
        """One chat turn: the reply, with what the episode recorded under `burstrl`."""
        view = self.served(job_id)  # the job's state first: a paused job says so, whatever the episode
        ep = self.episode(job_id, episode_id)
        tpl = self.template()
        try:
            msgs = [normal(m) for m in req["messages"]]
        except ChatError as e:
            raise AgentError(422, f"messages: {e}") from None
        tools = req.get("tools") or None
        with self._busy(ep, "chat"):
            try:
                if not ep.messages:
                    ep.tools = tools
                    new_ids, prompt = tpl.first_ids(msgs, tools), True
                else:
                    new = check_extends(ep.messages, msgs)
                    if tools != ep.tools:
                        raise AgentError(409, "tools: an episode's tools are fixed by its first call")
                    new_ids, prompt = tpl.delta_ids(ep.messages, new, ep.last_generated, tools), False
            except HistoryMismatch as e:
                raise AgentError(409, str(e)) from None
            except ChatError as e:
                raise AgentError(422, f"messages: {e}") from None
            turn = self._run(ep, view, new_ids, prompt, req)
            s = turn.sample
            cfg = turn.cfg
            text = strip_stop(s.text, cfg.stop, s.finish_reason)
            content, calls = parse_tool_calls(text) if tools else (text, [])
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            ep.messages = [*msgs, normal(reply)]
            ep.answer = content
        finish = "length" if s.finish_reason == "length" else ("tool_calls" if calls else "stop")
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": f"{job_id}@v{turn.version}",
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": usage(turn),
            "burstrl": self._record(ep, turn),
        }

    def complete(self, job_id: str, episode_id: str, req: dict[str, Any]) -> dict[str, Any]:
        """One completion turn: `prompt` must extend the episode's text so far."""
        view = self.served(job_id)
        ep = self.episode(job_id, episode_id)
        prompt = req["prompt"]
        with self._busy(ep, "completion"):
            tok = self.template()
            if not ep.text and not ep.prompt_ids:
                new_ids, first = list(tok.tok.encode(prompt, add_special_tokens=True)), True
            else:
                if not prompt.startswith(ep.text):
                    raise AgentError(
                        409,
                        "prompt: does not start with this episode's text so far (its first prompt and the completions "
                        "returned): extend it, do not rewrite it",
                    )
                new_ids, first = tok.encode(prompt[len(ep.text) :]), False
            turn = self._run(ep, view, new_ids, first, req)
            text = strip_stop(turn.sample.text, turn.cfg.stop, turn.sample.finish_reason)
            ep.text = prompt + text
            ep.answer = text
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": f"{job_id}@v{turn.version}",
            "choices": [{"index": 0, "text": text, "finish_reason": turn.sample.finish_reason, "logprobs": None}],
            "usage": usage(turn),
            "burstrl": self._record(ep, turn),
        }

    def close(self, job_id: str, episode_id: str, how: str, parts: dict[str, float], answer: str | None) -> dict:
        """Close an episode with a reward ("reward", its parts) or for the verifiers ("verify");
        the last one of its group puts the group on the bus."""
        ep = self.episodes.get(episode_id)
        if ep is None or ep.group.job_id != job_id:
            raise AgentError(404, f"no open episode {episode_id!r} of job {job_id} on this replica")
        g = ep.group
        with self.lock:
            if g.ended:
                raise AgentError(409, f"episode {episode_id}'s group has left: {g.ended}")
            if ep.closed:
                raise AgentError(409, f"episode {episode_id} is closed already ({ep.closed})")
            if ep.busy:
                raise AgentError(409, f"episode {episode_id} has a turn in progress")
            if not ep.turns:
                raise AgentError(409, f"episode {episode_id} has no model turn yet: nothing to reward")
            others = {e.closed for e in g.episodes if e.closed}
            if others and others != {how}:
                raise AgentError(
                    409,
                    f"the other episodes of group {g.id} were closed by {others.pop()}: a group is rewarded one way",
                )
            ep.closed = how
            ep.reward_parts = dict(parts)
            if answer is not None:
                ep.answer = answer
            complete = all(e.closed for e in g.episodes)
        if complete:
            self._hand_on(g, how)
        return {"episode": ep.id, "group": g.id, "group_state": g.ended or "open", "closed": how}

    def status(self, job_id: str, episode_id: str) -> dict[str, Any]:
        ep = self.episodes.get(episode_id)
        if ep is None or ep.group.job_id != job_id:
            raise AgentError(404, f"no open episode {episode_id!r} of job {job_id} on this replica")
        g = ep.group
        return {
            "episode": ep.id,
            "group": g.id,
            "turns": ep.turns,
            "closed": ep.closed,
            "group_state": g.ended or "open",
            "policy_version": g.lease.version if g.lease else None,
            "deadline_at": g.deadline_at,
            "token_ids": ep.prompt_ids + ep.ids,
            "loss_mask": [0] * len(ep.prompt_ids) + ep.mask,
        }

    def _busy(self, ep: AgentEpisode, mode: str) -> _Busy:
        return _Busy(self, ep, mode)

    def _run(self, ep: AgentEpisode, view: ServedJob, new_ids: list[int], first: bool, req: dict[str, Any]) -> Turn:
        """Queue the turn for the worker, wait, and record it into the episode."""
        spec = view.rec.spec
        if ep.turns >= spec.agent.max_turns:
            raise AgentError(409, f"episode {ep.id} has taken its agent.max_turns = {spec.agent.max_turns} turns")
        context = new_ids if first else ep.prompt_ids + ep.ids + new_ids
        room = self.leases.context - len(context)
        if room < 1:
            raise AgentError(
                422,
                f"messages: the episode's context would hold {len(context)} tokens, the engine's is {self.leases.context}",
            )
        cfg = sampling_of(spec, n=1)
        want = req.get("max_completion_tokens") or req.get("max_tokens") or cfg.max_tokens
        stop = req.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        cfg = dataclasses.replace(
            cfg,
            max_tokens=max(1, min(int(want), cfg.max_tokens, room)),
            stop=tuple(dict.fromkeys((*cfg.stop, *stop))),
            include_stop=True,  # the ids hold the stop string anyway: the text says so too, stripped for the reply
        )
        turn = Turn(ep, list(context), cfg)
        self.turns.put(turn)
        if not turn.done.wait(TURN_WAIT_S):
            raise AgentError(503, f"no engine turn within {TURN_WAIT_S:.0f} s (rollout busy or its engine away)")
        if turn.error is not None:
            raise turn.error
        s = turn.sample
        if first:
            ep.prompt_ids = list(new_ids)
        else:
            ep.ids += new_ids
            ep.logprobs += [0.0] * len(new_ids)
            ep.mask += [0] * len(new_ids)
        ep.turn_starts.append(len(ep.ids))
        ep.ids += list(s.token_ids)
        ep.logprobs += list(s.logprobs)
        ep.mask += [1] * len(s.token_ids)
        ep.last_generated = list(s.token_ids)
        ep.finish_reason = s.finish_reason
        ep.turns += 1
        self.m_turns.inc()
        return turn

    @staticmethod
    def _record(ep: AgentEpisode, turn: Turn) -> dict[str, Any]:
        """What the episode recorded for this turn (the trainer sees exactly these ids)."""
        return {
            "episode": ep.id,
            "group": ep.group.id,
            "policy_version": turn.version,
            "prompt_token_ids": turn.context,
            "completion_token_ids": list(turn.sample.token_ids),
            "completion_logprobs": list(turn.sample.logprobs),
        }

    # -- leaving the replica (HTTP side for closes, the worker for deadlines) -----------
    def _hand_on(self, g: AgentGroup, how: str) -> None:
        view = self.jobs.get(g.job_id)
        uses_ref = view.rec.spec.uses_ref if view is not None else False
        skip = common_prefix([e.prompt_ids for e in g.episodes])
        msg = GroupMsg(
            job_id=g.job_id,
            group_id=g.id,
            item_id=g.fields.get("item_id", g.id),
            prompt=prompt_text(g.episodes[0]),
            prompt_ids=pack_i32(g.episodes[0].prompt_ids[:skip]),
            fields=g.fields,
            policy_version=g.lease.version if g.lease else 0,
            sampled_at=g.sampled_at or time.time(),
            completions=[e.completion(skip) for e in g.episodes],
        )
        counters = {"fed": 1, "produced": 1}
        if how == "reward":
            msg.stage = "scored" if uses_ref else "ready"
            stream = keys.scored(g.job_id) if uses_ref else keys.ready(g.job_id)
            counters["scored"] = 1
        else:
            stream = keys.rollouts(g.job_id)
        self._leave(g, "bus", [(stream, encode(msg))], counters)

    def _drop(self, g: AgentGroup, reason: str) -> None:
        self._leave(g, f"dropped_{reason}", [], {"fed": 1, f"dropped_{reason}": 1})

    def _leave(self, g: AgentGroup, outcome: str, outputs: list[tuple[str, bytes]], counters: dict[str, int]) -> None:
        try:
            done = inject(self.rt.redis, g.job_id, g.id, outputs, counters, outcome=outcome)
        except UnknownJob as e:  # Redis lost the job since the group opened: the api's recovery redoes it
            log.error("%s; the group is dropped here, nothing written", e)
            g.ended = outcome = "job_lost"
        else:
            if done:
                g.ended = outcome
                self._record_reward(g, outcome)
            else:  # a close raced the deadline (or a retry): the first outcome stands, counted once
                got = self.rt.redis.hget(keys.agent_groups(g.job_id), g.id)
                g.ended = got.decode() if isinstance(got, bytes) else str(got or "left")
                log.warning("agent group %s had left already (%s); not counted again", g.id, g.ended)
        with self.lock:
            for e in g.episodes:
                self.episodes.pop(e.id, None)
        self.m_groups.labels(outcome).inc()
        log.info("job %s: agent group %s -> %s", g.job_id, g.id, outcome)

    def _record_reward(self, g: AgentGroup, outcome: str) -> None:
        """A rewarded group that entered the bus: its rewards as the reward stage's metrics point."""
        if outcome == "bus" and any(e.closed == "reward" for e in g.episodes):
            rewards = [sum(e.reward_parts.values()) for e in g.episodes]
            record_point(
                self.rt.redis,
                g.job_id,
                "reward",
                {"groups": 1, "completions": len(rewards), "reward_mean": sum(rewards) / len(rewards), "agent": True},
            )

    # -- worker side ---------------------------------------------------------------
    def step(self) -> None:
        """In the worker's loop: drop groups past their deadline or of jobs no longer served,
        free the leases of groups that left, and run the queued turns."""
        now = time.time()
        for g in list(self.groups.values()):
            if not g.ended:
                view = self.jobs.get(g.job_id)
                if view is None or view.rec.state not in (JobState.running, JobState.paused):
                    self._drop(g, "agent_job_ended")
                elif now > g.deadline_at and not any(e.busy for e in g.episodes):
                    self._drop(g, "agent_deadline")
            if g.ended:
                self.groups.pop(g.id, None)
                if g.lease is not None and (view := self.jobs.get(g.job_id)) is not None:
                    self.leases.release(view, g.lease)
                g.lease = None
        self.m_open.set(len(self.groups))
        turns: list[Turn] = []
        while True:
            try:
                turns.append(self.turns.get_nowait())
            except queue.Empty:
                break
        by_cfg: dict[SamplingConfig, list[Turn]] = {}
        for t in turns:
            g = t.episode.group
            view = self.jobs.get(g.job_id)
            if view is None or g.ended:
                t.error = AgentError(409, f"group {g.id} has left ({g.ended or 'job not served'})")
                t.done.set()
                continue
            if g.lease is None:
                g.lease, g.sampled_at = self.leases.take(view), time.time()
            by_cfg.setdefault(t.cfg, []).append(t)
        for cfg, batch in by_cfg.items():
            self._generate(cfg, batch)

    def _generate(self, cfg: SamplingConfig, batch: list[Turn]) -> None:
        t0 = time.time()
        # `step` gave every group of the batch its lease
        adapters = [t.episode.group.lease.adapter if t.episode.group.lease else None for t in batch]
        try:
            gens = self.leases.engine.generate_ids([t.context for t in batch], adapters, cfg)
        except EngineUnavailable as e:
            for t in batch:
                t.error = AgentError(503, f"engine unavailable: {e}")
                t.done.set()
            raise
        except RequestFailed as e:
            if len(batch) > 1:  # one at a time: one bad request must not fail its neighbours
                for t in batch:
                    self._generate(cfg, [t])
                return
            batch[0].error = AgentError(422, f"engine refused the turn: {e}")
            batch[0].done.set()
            return
        finally:
            self.leases.busy_s += time.time() - t0
        for t, g in zip(batch, gens, strict=True):
            t.sample = g.samples[0]
            t.version = t.episode.group.lease.version  # type: ignore[union-attr]
            t.done.set()

    def close_all(self) -> None:
        """Refuse the turns still queued (the service is stopping)."""
        while True:
            try:
                t = self.turns.get_nowait()
            except queue.Empty:
                return
            t.error = AgentError(503, "rollout is stopping")
            t.done.set()


class _Busy:
    """One call at a time per episode, of one mode (chat or completion) for its life."""

    def __init__(self, srv: AgentServer, ep: AgentEpisode, mode: str) -> None:
        self.srv, self.ep, self.mode = srv, ep, mode

    def __enter__(self) -> None:
        with self.srv.lock:
            if self.ep.closed:
                raise AgentError(409, f"episode {self.ep.id} is closed ({self.ep.closed}): no more turns")
            if self.ep.busy:
                raise AgentError(409, f"episode {self.ep.id} has a turn in progress: one call at a time per episode")
            if self.ep.mode and self.ep.mode != self.mode:
                raise AgentError(409, f"episode {self.ep.id} is a {self.ep.mode} episode: keep to one endpoint")
            self.ep.busy, self.ep.mode = True, self.mode

    def __exit__(self, *exc: object) -> None:
        with self.srv.lock:
            self.ep.busy = False
