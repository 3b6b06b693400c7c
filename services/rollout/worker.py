"""Rollout worker: adopt new policy versions, evaluate them, turn prompts into groups.

Per job it keeps the adapter of the newest verified version. Adoption: download into a
fresh folder, verify every sha256 against the manifest, then switch new requests to a
new adapter name; the previous one is unloaded (requests are synchronous here, so none
are in flight). A version that fails verification is never served: the job keeps its
last good version and /readyz names the failure.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from prometheus_client import Counter, Gauge

from services.rollout.engine import Adapter, InProcessEngine
from services.rollout.settings import RolloutSettings
from shared import keys
from shared.bus import Bus, Entry
from shared.job import JobRecord, JobState, load_job, same_model
from shared.metrics import record_eval, record_point
from shared.policy import StoreError, fetch_version
from shared.schema import Completion, GroupMsg, PromptMsg, decode, encode, pack_f32, pack_i32, pack_u8
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore
from shared.tasks import get_task
from shared.tasks.base import total

log = logging.getLogger(__name__)


@dataclass
class JobView:
    rec: JobRecord
    version: int = 0
    adapter: Adapter | None = None
    failed: dict[int, str] = field(default_factory=dict)  # version -> why it was refused


class RolloutWorker:
    def __init__(
        self, rt: ServiceRuntime, settings: RolloutSettings, engine: InProcessEngine, store: ObjectStore
    ) -> None:
        self.rt, self.s, self.engine, self.store = rt, settings, engine, store
        self.bus = Bus(rt.redis, keys.GROUP_ROLLOUT, settings.replica)
        self.jobs: dict[str, JobView] = {}
        self.cache = settings.data_dir / "adapters" / f"{settings.replica}-{uuid.uuid4().hex[:6]}"
        reg = rt.registry
        self.m_tokens = Counter("burstrl_rollout_tokens", "Completion tokens generated", registry=reg)
        self.m_groups = Counter("burstrl_rollout_groups", "Groups produced", registry=reg)
        self.m_adopt = Gauge("burstrl_rollout_adopt_seconds", "Publish -> adopt latency", ["job"], registry=reg)
        self.m_verify_fail = Counter("burstrl_rollout_verify_failures", "Refused versions", registry=reg)

    # -- jobs and versions -----------------------------------------------------------
    def refresh_jobs(self) -> None:
        live = set()
        for job_id in active_job_ids(self.rt.redis):
            rec = load_job(self.rt.redis, job_id)
            if rec is None or not same_model(rec.spec.base_model, self.s.model):
                continue  # another rollout pool serves other base models
            live.add(job_id)
            view = self.jobs.setdefault(job_id, JobView(rec))
            view.rec = rec
            self.adopt_latest(view)
        for gone in set(self.jobs) - live:
            view = self.jobs.pop(gone)
            if view.adapter:
                self.engine.unload(view.adapter)
        self.rt.gauges["policy_versions"] = {j: v.version for j, v in self.jobs.items()}

    def adopt_latest(self, view: JobView) -> None:
        pointer = int(self.rt.redis.get(keys.policy_pointer(view.rec.id)) or 0)
        if pointer <= view.version or pointer in view.failed:
            return
        job_id = view.rec.id
        dest = self.cache / job_id / f"policy-v{pointer}"
        shutil.rmtree(dest, ignore_errors=True)
        try:
            manifest = fetch_version(self.store, job_id, pointer, dest)
        except StoreError as e:
            view.failed[pointer] = str(e)
            self.m_verify_fail.inc()
            self.rt.health.set(f"policy:{job_id}", False, f"v{pointer} refused: {e}")
            return
        old = view.adapter
        view.adapter = self.engine.new_adapter(f"{job_id}-policy-v{pointer}", str(dest))
        view.version = pointer
        if old:
            self.engine.unload(old)
            shutil.rmtree(old.path, ignore_errors=True)
        self.m_adopt.labels(job_id).set(time.time() - manifest.created_at)
        self.rt.health.set(f"policy:{job_id}", True)
        log.info("job %s: adopted policy v%d (%.2fs after publish)", job_id, pointer, time.time() - manifest.created_at)

    # -- evaluation ------------------------------------------------------------------
    def evaluate_pending(self) -> None:
        """Held-out evaluation of each adopted version, once across all replicas."""
        r = self.rt.redis
        for view in self.jobs.values():
            spec, v = view.rec.spec, view.version
            if spec.eval_size == 0 or r.hexists(keys.evals(view.rec.id), str(v)):
                continue
            if not r.set(keys.eval_claim(view.rec.id, v), self.s.replica, nx=True, ex=600):
                continue
            task = get_task(spec.task)
            items = task.heldout_items(spec.eval_size)
            prompts = [it.prompt for it in items]
            t0 = time.time()
            sampled = self.engine.generate(
                prompts,
                [view.adapter] * len(items),
                n=self.s.eval_samples,
                temperature=spec.sampling.temperature,
                top_p=spec.sampling.top_p,
                max_tokens=spec.sampling.max_tokens,
            )
            greedy = self.engine.generate(
                prompts,
                [view.adapter] * len(items),
                n=1,
                temperature=0.0,
                top_p=1.0,
                max_tokens=spec.sampling.max_tokens,
            )
            rewards = [
                total(task.score(s.text, it.fields)) for g, it in zip(sampled, items, strict=True) for s in g.samples
            ]
            greedy_ok = [total(task.score(g.samples[0].text, it.fields)) for g, it in zip(greedy, items, strict=True)]
            result = {
                "accuracy": sum(x >= 1.0 for x in rewards) / len(rewards),
                "mean_reward": sum(rewards) / len(rewards),
                "greedy_accuracy": sum(x >= 1.0 for x in greedy_ok) / len(greedy_ok),
                "n_prompts": len(items),
                "samples_per_prompt": self.s.eval_samples,
                "seconds": round(time.time() - t0, 2),
            }
            record_eval(r, view.rec.id, v, result)
            log.info(
                "job %s v%d held-out: acc %.3f greedy %.3f",
                view.rec.id,
                v,
                result["accuracy"],
                result["greedy_accuracy"],
            )

    # -- generation ------------------------------------------------------------------
    def generate_once(self) -> dict[str, int]:
        """One engine round over the served jobs' prompts; groups produced per job."""
        running = {j: v for j, v in self.jobs.items() if v.rec.state == JobState.running}
        entries = self.bus.read([keys.prompts(j) for j in running], count=self.s.prompts_per_batch, block_ms=500)
        if not entries:
            return {}
        todo: list[tuple[Entry, PromptMsg, JobView]] = []
        for e in entries:
            view = running.get(e.job_id)
            try:
                msg = decode(e.data, PromptMsg)
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as err:
                self.bus.dead_letter(e, f"undecodable prompt: {err}")
                continue
            if view is None:
                self.bus.dead_letter(e, "job is not served by this rollout pool")
                continue
            todo.append((e, msg, view))
        # One engine call per sampling config; jobs differ in G and sampling settings.
        by_cfg: dict[tuple, list[tuple[Entry, PromptMsg, JobView]]] = {}
        for t in todo:
            sp = t[2].rec.spec
            by_cfg.setdefault(
                (sp.group_size, sp.sampling.temperature, sp.sampling.top_p, sp.sampling.max_tokens), []
            ).append(t)
        produced: dict[str, int] = {}
        for (n, temp, top_p, max_tokens), batch in by_cfg.items():
            gens = self.engine.generate(
                [m.prompt for _, m, _ in batch],
                [v.adapter for _, _, v in batch],
                n=n,
                temperature=temp,
                top_p=top_p,
                max_tokens=max_tokens,
            )
            now = time.time()
            for (e, msg, view), gen in zip(batch, gens, strict=True):
                group = GroupMsg(
                    job_id=msg.job_id,
                    group_id=msg.group_id,
                    item_id=msg.item_id,
                    prompt=msg.prompt,
                    prompt_ids=pack_i32(gen.prompt_ids),
                    fields=msg.fields,
                    policy_version=view.version,
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
                self.bus.forward([e], [(keys.rollouts(msg.job_id), encode(group))], {msg.job_id: {"produced": 1}})
                self.m_tokens.inc(sum(len(s.token_ids) for s in gen.samples))
                produced[msg.job_id] = produced.get(msg.job_id, 0) + 1
        self.m_groups.inc(sum(produced.values()))
        return produced

    def tick(self) -> None:
        self.refresh_jobs()
        self.evaluate_pending()
        t0 = time.time()
        produced = self.generate_once()
        seconds = round(time.time() - t0, 3)
        for job_id, groups in produced.items():
            record_point(self.rt.redis, job_id, "rollout", {"groups": groups, "seconds": seconds})
