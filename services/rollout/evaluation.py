"""Held-out evaluation of each adopted version, once across all replicas, without ever
holding up adoption or generation.

An evaluation runs in rounds of `eval_chunk` held-out prompts, one round per worker tick,
between the tick's adoption check and its generation round: a version published while a
long evaluation runs is adopted within one round of each. The evaluation holds a lease on
the version it evaluates (services/rollout/served.py) from its first round to its last, so
that version stays loaded meanwhile, whatever is adopted.

Answers are scored as the reward service scores them (shared/domain/scoring.py: the job's
task and verifiers, each group under its task's deadline, in worker processes), on a thread
of their own: a verifier that hangs on one answer costs that group its deadline (scored 0,
tagged "timeout") and never stalls the rollout loop.

Single-turn and multi-turn jobs share one path: a round samples k answers and one greedy
answer per prompt (multi-turn: whole episodes, whose final answers are verified and whose
environment reward parts are added, as the reward service does).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from services.rollout.episodes import Episode, episode_stats
from services.rollout.errors import EngineUnavailable, RequestFailed
from services.rollout.served import Leases, ServedJob, ServedVersion, sampling_of
from services.rollout.settings import RolloutSettings
from shared import keys
from shared.domain.envs import EnvError
from shared.domain.scoring import GroupWork, Scorer, group_work
from shared.domain.tasks import task_for_job
from shared.domain.tasks.base import TaskItem, total
from shared.domain.verifiers import TagBudget, split_parts
from shared.metrics import record_eval
from shared.service import ServiceRuntime

log = logging.getLogger(__name__)
CLAIM_TTL_S = 600  # an evaluation claim outlives a crashed replica by this much; renewed every round


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class Round:
    """One round's answers, being scored: per prompt a group of k sampled answers, then one greedy."""

    n_items: int
    scores: Future  # -> list[list[dict[str, float]]]: [sampled_0, greedy_0, sampled_1, greedy_1, ...]
    env_rewards: list[list[float]]  # per prompt, per sampled answer: the environment's reward parts (0: single-turn)
    episodes: list[Episode]  # the sampled episodes (multi-turn), for their statistics


@dataclass
class Evaluation:
    view: ServedJob
    version: int
    lease: ServedVersion | None  # on `version`; given back once the last round is generated
    items: list[TaskItem]
    k: int
    t0: float = field(default_factory=time.time)
    next: int = 0  # the next held-out prompt to generate for
    rounds: list[Round] = field(default_factory=list)

    @property
    def generating(self) -> bool:
        return self.next < len(self.items)


class Evaluator:
    def __init__(self, rt: ServiceRuntime, settings: RolloutSettings, leases: Leases) -> None:
        self.rt, self.s, self.leases = rt, settings, leases
        self.scorer = Scorer(
            settings.score_workers, settings.score_plugin_modules, setting="BURSTRL_ROLLOUT_SCORE_PLUGINS"
        )
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-score")  # the scorer's one caller
        self.running: dict[str, Evaluation] = {}  # job -> its evaluation in progress
        self._turn = ""  # the job whose evaluation ran the last round (rounds go round-robin)
        self.tags = TagBudget()  # the score tags an evaluation may record per job (drawn from completions)
        self._given_up: set[tuple[str, int]] = set()  # (job, version) this replica could not evaluate

    @property
    def generating(self) -> bool:
        """Whether an evaluation has rounds to run (the loop then reads prompts without waiting)."""
        return any(ev.generating for ev in self.running.values())

    def step(self, jobs: dict[str, ServedJob]) -> None:
        """Record finished evaluations, start due ones, and run one round of one of them."""
        for job_id, ev in list(self.running.items()):
            if ev.generating and jobs.get(job_id) is not ev.view:  # no longer served here: its lease is void
                self._abandon(ev, "the job is no longer served by this pool")
            elif not ev.generating and all(x.scores.done() for x in ev.rounds):
                self._finish(ev)
        for view in jobs.values():
            if view.id not in self.running:
                self._start(view)
        turn = [j for j in sorted(self.running) if self.running[j].generating]
        if turn:
            job_id = next((j for j in turn if j > self._turn), turn[0])
            self._turn = job_id
            self._round(self.running[job_id])

    def abandon_all(self, why: str) -> None:
        """Give up every evaluation still generating (the engine went away: their adapters may be gone)."""
        for ev in list(self.running.values()):
            if ev.generating:
                self._abandon(ev, why)

    # -- one evaluation --------------------------------------------------------------
    def _start(self, view: ServedJob) -> None:
        r, spec, v = self.rt.redis, view.rec.spec, view.version
        if spec.eval_size == 0 or (view.id, v) in self._given_up or r.hexists(keys.evals(view.id), str(v)):
            return
        if not r.set(keys.eval_claim(view.id, v), self.s.replica, nx=True, ex=CLAIM_TTL_S):
            return  # another replica evaluates it
        try:
            items = task_for_job(spec).heldout_items(spec.eval_size)
        except Exception:  # an unreadable held-out source is one job's problem: never the loop's
            self.rt.errors.labels("eval").inc()
            log.exception("job %s: no held-out items", view.id)
            self._give_up(view.id, v, "no held-out items")
            return
        if not items:
            self._give_up(view.id, v, f"its task has no held-out items (eval_size {spec.eval_size})")
            return
        lease = self.leases.take(view)
        view.evaluating = lease
        self.running[view.id] = Evaluation(view, v, lease, items, self.s.eval_samples)
        log.info("job %s: evaluating v%d on %d held-out prompts", view.id, v, len(items))

    def _round(self, ev: Evaluation) -> None:
        """Generate one round of answers on the evaluation's lease and hand them to the scorer."""
        items = ev.items[ev.next : ev.next + self.s.eval_chunk]
        try:
            works, env_rewards, episodes = self._evaluate(ev, items)
        except EngineUnavailable:
            self._abandon(ev, "the engine went away")
            raise
        except (RequestFailed, EnvError) as e:  # the job's prompts or environment, not the service
            self._abandon(ev, f"{type(e).__name__}: {e}")
            self._given_up.add((ev.view.id, ev.version))
            return
        ev.rounds.append(Round(len(items), self._scoring.submit(self.scorer.score, works), env_rewards, episodes))
        ev.next += len(items)
        claim = keys.eval_claim(ev.view.id, ev.version)
        if self.rt.redis.get(claim) == self.s.replica.encode():
            self.rt.redis.expire(claim, CLAIM_TTL_S)
        if not ev.generating:
            self._release(ev)  # the answers are in: the version may be unloaded now

    def _evaluate(
        self, ev: Evaluation, items: list[TaskItem]
    ) -> tuple[list[GroupWork], list[list[float]], list[Episode]]:
        """k sampled and one greedy answer per prompt, and the work of scoring them."""
        spec, k, lease = ev.view.rec.spec, ev.k, ev.lease
        assert lease is not None
        sampled_cfg, greedy_cfg = sampling_of(spec, n=k), sampling_of(spec, n=1, temperature=0.0)
        if spec.env.name:
            sampled = [
                (lease, self.leases.new_episodes(it.prompt, dict(it.fields), spec, sampled_cfg, k)) for it in items
            ]
            greedy = [
                (lease, self.leases.new_episodes(it.prompt, dict(it.fields), spec, greedy_cfg, 1)) for it in items
            ]
            self.leases.run_on(sampled, k)
            self.leases.run_on(greedy, 1)
            answers = [
                ([ep.answer for ep in s], [len(ep.ids) for ep in s], [ep.answer for ep in g], [len(ep.ids) for ep in g])
                for (_, s), (_, g) in zip(sampled, greedy, strict=True)
            ]
            env_rewards = [[sum(ep.parts.values()) for ep in eps] for _, eps in sampled]
            episodes = [ep for _, eps in sampled for ep in eps]
        else:
            prompts = [(p, lease) for p in self.leases.render([(it.prompt, spec) for it in items])]
            gens = self.leases.generate_on(prompts, sampled_cfg)
            greedy_gens = self.leases.generate_on(prompts, greedy_cfg)
            answers = [
                (
                    [s.text for s in g.samples],
                    [len(s.token_ids) for s in g.samples],
                    [s.text for s in gg.samples],
                    [len(s.token_ids) for s in gg.samples],
                )
                for g, gg in zip(gens, greedy_gens, strict=True)
            ]
            env_rewards = [[0.0] * k for _ in items]
            episodes = []
        works = []
        for it, (texts, lens, greedy_texts, greedy_lens) in zip(items, answers, strict=True):
            for t, n in ((texts, lens), (greedy_texts, greedy_lens)):
                works.append(group_work(spec, t, dict(it.fields), prompt=it.prompt, completion_tokens=n))
        return works, env_rewards, episodes

    def _finish(self, ev: Evaluation) -> None:
        del self.running[ev.view.id]
        self._release(ev)  # given back after its last round already; never left held
        try:
            result = self._result(ev)
        except Exception:  # a bug in scoring: counted and logged, and the loop goes on
            self.rt.errors.labels("eval").inc()
            log.exception("job %s: scoring the evaluation of v%d failed", ev.view.id, ev.version)
            self._give_up(ev.view.id, ev.version, "scoring failed")
            return
        record_eval(self.rt.redis, ev.view.id, ev.version, result)
        log.info(
            "job %s v%d held-out: pass@1 %.3f pass@%d %.3f greedy %.3f (%.1fs)",
            ev.view.id,
            ev.version,
            result["pass@1"],
            ev.k,
            result[f"pass@{ev.k}"],
            result["greedy_accuracy"],
            result["seconds"],
        )

    def _result(self, ev: Evaluation) -> dict[str, Any]:
        k = ev.k
        rewards: list[float] = []
        correct: list[int] = []
        greedy_ok: list[bool] = []
        tags: Counter[str] = Counter()
        for rnd in ev.rounds:
            scores = rnd.scores.result()
            for i in range(rnd.n_items):
                sampled, greedy = scores[2 * i], scores[2 * i + 1]
                verified = [total(p) for p in sampled]  # the verifiers' reward: correct when >= 1
                rewards.extend(v + e for v, e in zip(verified, rnd.env_rewards[i], strict=True))
                correct.append(sum(v >= 1.0 for v in verified))
                greedy_ok.append(total(greedy[0]) >= 1.0)
                tags.update(t for p in [*sampled, *greedy] for t in split_parts(self.tags.bound(ev.view.id, p))[1])
        n = len(correct)
        p1 = sum(pass_at_k(k, c, 1) for c in correct) / n
        result: dict[str, Any] = {
            "accuracy": p1,  # kept for older readers: the same as pass@1
            "pass@1": p1,
            f"pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / n,
            "mean_reward": sum(rewards) / len(rewards),
            "greedy_accuracy": sum(greedy_ok) / n,
            "n_prompts": n,
            "samples_per_prompt": k,
            "score_tags": dict(tags),  # verifier errors and timeouts ("verifier!timeout": answers)
            "seconds": round(time.time() - ev.t0, 2),
        }
        if ev.view.rec.spec.env.name:
            st = episode_stats([ep for rnd in ev.rounds for ep in rnd.episodes])
            for key in ("turns_mean", "tool_calls_mean", "tool_errors", "length_mean"):
                result[key] = st[key]
        return result

    def _release(self, ev: Evaluation) -> None:
        if ev.lease is None:
            return
        lease, ev.lease = ev.lease, None
        if ev.view.evaluating is lease:
            ev.view.evaluating = None
        self.leases.release(ev.view, lease)

    def _abandon(self, ev: Evaluation, why: str) -> None:
        log.warning("job %s: evaluation of v%d abandoned: %s", ev.view.id, ev.version, why)
        self.running.pop(ev.view.id, None)
        self._release(ev)
        self.rt.redis.delete(keys.eval_claim(ev.view.id, ev.version))  # let another replica (or a later tick) try

    def _give_up(self, job_id: str, v: int, why: str) -> None:
        log.error("job %s: cannot evaluate v%d: %s", job_id, v, why)
        self._given_up.add((job_id, v))
        self.rt.redis.delete(keys.eval_claim(job_id, v))

    def close(self) -> None:
        for ev in list(self.running.values()):
            self._release(ev)
            # Unfinished: let another replica evaluate it now, not once the claim expires.
            claim = keys.eval_claim(ev.view.id, ev.version)
            try:
                if self.rt.redis.get(claim) == self.s.replica.encode():
                    self.rt.redis.delete(claim)
            except Exception:  # noqa: BLE001 - closing: the claim expires by itself anyway
                log.warning("job %s: could not give back the evaluation claim of v%d", ev.view.id, ev.version)
        self._scoring.shutdown(wait=False, cancel_futures=True)
        self.scorer.close()
