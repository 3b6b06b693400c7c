"""The rollout worker's loop: which jobs this pool serves, the engine's health, and one tick
of adoption, evaluation and generation.

Each tick:
1. if the engine was lost, check it again (and reload the served adapters once it is back);
2. refresh the served jobs and adopt each one's newest version (services/rollout/adoption.py);
3. run one round of a held-out evaluation, if one is due (services/rollout/evaluation.py);
4. run one generation round over the served jobs' prompts (services/rollout/generation.py),
   adopting first any version published meanwhile;
5. run the agent turns queued by the OpenAI-compatible endpoint, drop agent groups past their
   deadline (services/rollout/agents.py), and the Tinker API's sample calls
   (services/rollout/tinker_sampling.py).
An evaluation round and a generation round are of similar size, so a version published at
any moment is adopted within one round of each, however long an evaluation runs.

What rollout decided about a version or a job is reported in one place
(services/rollout/reporting.py); leases, the version each request runs on, in
services/rollout/served.py; the error taxonomy in services/rollout/errors.py.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from services.rollout.adoption import Adopter
from services.rollout.agents import AgentServer
from services.rollout.engine import Engine
from services.rollout.errors import AdapterError, EngineUnavailable, ProbeMismatch, RequestFailed
from services.rollout.evaluation import Evaluator
from services.rollout.generation import Generator
from services.rollout.reporting import Reporter
from services.rollout.served import Leases, ServedJob
from services.rollout.settings import RolloutSettings
from services.rollout.tinker_sampling import TinkerSampler
from shared import keys
from shared.domain.envs import load_env_plugins
from shared.job import JobRecord, UnreadableJob, load_job, same_model
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore

log = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(self, rt: ServiceRuntime, settings: RolloutSettings, engine: Engine, store: ObjectStore) -> None:
        load_env_plugins(settings.env_plugin_modules)  # fail at start, in the service, if one is missing
        self.rt, self.s, self.engine = rt, settings, engine
        self.bus = rt.stage_bus(keys.GROUP_ROLLOUT)
        self.jobs: dict[str, ServedJob] = {}
        # This process's own folder (mkdtemp: never another replica's, even one of the same name).
        (settings.data_dir / "adapters").mkdir(parents=True, exist_ok=True)
        self.cache = Path(tempfile.mkdtemp(prefix=f"{settings.replica}-", dir=settings.data_dir / "adapters"))
        self.engine_ok = True
        self.reporter = Reporter(rt)
        self.leases = Leases(engine, rt.registry, settings.max_model_len, settings.model)
        self.adopter = Adopter(rt, settings, engine, store, self.leases, self.reporter, self.jobs, self.cache)
        self.evaluator = Evaluator(rt, settings, self.leases)
        self.generator = Generator(rt, settings, self.bus, self.leases, self.adopter.adopt_latest)
        self.agents = AgentServer(rt, settings.model, self.leases, self.jobs)
        self.tinker = TinkerSampler(rt, self.leases, self.jobs, settings.replica)

    # -- the loop --------------------------------------------------------------------
    def tick(self) -> None:
        self.generator.window()
        if not self.engine_ready():
            self.rt.stop.wait(self.s.engine_retry_s)
            return
        try:
            self.refresh_jobs()
            self.agents.step()
            self.tinker.step()
            self.evaluator.step(self.jobs)
            # While an evaluation has rounds left, do not wait for prompts: its next round is due;
            # while agents have groups open (or Tinker models are served), their next turn (sample
            # call) is due within a few tens of ms.
            busy = self.evaluator.generating or self.agents.active or self.tinker.active
            self.generator.generate_once(self.jobs, block_ms=1 if self.evaluator.generating else 20 if busy else 500)
            self.agents.step()
        except EngineUnavailable as e:  # entries stay pending: replayed once the engine is back
            self._engine_down(e)

    # -- engine health ---------------------------------------------------------------
    def _engine_down(self, e: Exception) -> None:
        self.engine_ok = False
        self.rt.health.set("engine", False, str(e))
        self.evaluator.abandon_all(f"engine unavailable: {e}")

    def engine_ready(self) -> bool:
        if self.engine_ok:
            return True
        try:
            self.engine.check()
        except EngineUnavailable as e:
            self.rt.health.set("engine", False, str(e))
            return False
        try:
            self.adopter.reload_after_outage()
        except (EngineUnavailable, AdapterError, ProbeMismatch, RequestFailed) as e:
            self.rt.health.set("engine", False, f"engine back, but reloading adapters failed: {e}")
            return False
        self.engine_ok = True
        # Our own entries left pending by the outage: redone on the next read, not after
        # the bus's idle timeout.
        self.bus.redo_now()
        self.rt.health.set("engine", True)
        return True

    # -- which jobs this pool serves -------------------------------------------------
    def refresh_jobs(self) -> None:
        recs: dict[str, JobRecord] = {}
        for job_id in active_job_ids(self.rt.redis):
            try:
                rec = load_job(self.rt.redis, job_id)
            except UnreadableJob as e:  # one bad record must not stop the other jobs
                log.error("%s; not served", e)
                continue
            if rec is None or not same_model(rec.spec.base_model, self.s.model):
                continue  # another rollout pool serves other base models
            recs[job_id] = rec
        live = set(recs)
        adopter, refused = self.adopter, self.reporter.refused_jobs
        if adopter.full_owner is not None and adopter.full_owner not in live:
            adopter.restore_base()  # before its folder goes: an in-place restore may need to go back to it
        if adopter.full_owner is not None:
            # The engine serves this job's full weights as its base model: any other job
            # would sample from them. Only the owner is served until it ends (and, should
            # restoring the base model have failed, no job at all).
            owner = adopter.full_owner
            for job_id in live - {owner}:
                adopter.refuse_job(
                    job_id,
                    f"this rollout pool serves the full weights of job {owner} (they replace its base model); "
                    "waiting until that job ends, or give full-weight jobs a rollout pool of their own",
                )
            live &= {owner}
        for gone in set(self.jobs) - live:
            view = self.jobs.pop(gone)
            for x in [view.current, *view.retiring]:
                self.leases.drop(x)
            self.reporter.unserved(gone)
        for job_id in sorted(live):  # every served job first: a full-weight adoption checks who else is served
            view = self.jobs.setdefault(job_id, ServedJob(recs[job_id]))
            view.rec = recs[job_id]
            if job_id in refused and not view.blocked:
                adopter.accept_job(job_id)
        for job_id in sorted(live):
            view = self.jobs[job_id]
            self.leases.reap(view)
            adopter.adopt_latest(view)
        for job_id in set(refused) - set(recs):  # refused jobs that ended: forget them
            self.reporter.ended(job_id)
        self.reporter.served(self.jobs)

    @property
    def full_owner(self) -> str | None:
        return self.adopter.full_owner

    def leave(self) -> None:
        """Leave the consumer group for good (SIGTERM: the loop has stopped reading, and the
        round in progress was settled): whatever is still pending to this replica goes to a
        live peer, or to the next replica that reads (services/rollout/__main__.py)."""
        jobs = set(self.jobs) | set(active_job_ids(self.rt.redis))
        left = self.bus.leave(keys.prompts(j) for j in sorted(jobs))
        log.info(
            "left the rollout group: %d pending prompts handed to peers, %d held for the next replica",
            left.handed,
            left.held,
        )

    def close(self) -> None:
        self.agents.close_all()
        self.evaluator.close()
        for view in self.jobs.values():
            for x in [view.current, *view.retiring]:
                self.leases.drop(x)
        shutil.rmtree(self.cache, ignore_errors=True)
