"""Rollout worker: adopt new policy versions, evaluate them, turn prompts into groups.

Adoption of version N of a job (docs/architecture.md, "Weight sync"):
1. download into a fresh folder `policy-vN` and check every file's sha256 against the manifest;
2. load it into the engine under a NEW adapter name (`{job}-policy-vN`);
3. probe: the engine's per-token log-probs of the manifest's probe sequence under the new
   adapter must match the trainer's values within `probe_tolerance`;
4. switch new requests to it; the previous adapter is unloaded (and its folder deleted)
   once the requests that started on it have finished.
A version failing 1-3 never serves: the job keeps its last good version, and the refusal
shows in /readyz, in the `burstrl_rollout_verify_failures` metric, in the job's metrics
stream (source "rollout_version") and in the job record's `error`.

Full-weight versions (no adapter_config.json; `algorithm.finetune = "full"`) replace the
engine's base model: once no request is in flight on the job, the version's safetensors and
the base model's config/tokenizer files make a fresh model folder that the engine switches
to (`Engine.load_full`), then the probe runs under the new base weights; a failed probe
switches back. Since every other job would then sample from those weights, a full-weight
version is adopted only while the pool serves no other job, and while it serves one, other
jobs are refused (/readyz, job error, `burstrl_rollout_job_refused`). A remote engine
refuses full-weight versions (a server's base weights are fixed at its start).

Every request is leased to the version current when it was submitted and is tagged with
it; a job holds at most max_staleness + 1 adapters in the engine at once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis
from prometheus_client import Counter, Gauge, Histogram

from services.rollout.engine import Adapter, AdapterError, Engine, EngineError, SamplingConfig
from services.rollout.episodes import Episode, episode_stats, new_episode, run_episodes, stuck_env_calls
from services.rollout.settings import RolloutSettings
from shared import keys
from shared.bus import Bus, Entry
from shared.domain.envs import EnvError, load_env_plugins
from shared.domain.tasks import task_for_job
from shared.domain.tasks.base import total
from shared.job import JobRecord, JobSpec, JobState, UnreadableJob, load_job, same_model, update_job
from shared.metrics import record_eval, record_point
from shared.policy import (
    MANIFEST,
    Manifest,
    ProbeMismatch,
    StoreError,
    VerificationError,
    check_probe,
    fetch_version,
    read_pointer,
    version_prefix,
)
from shared.schema import Completion, GroupMsg, PromptMsg, encode, pack_f32, pack_i32, pack_u8
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore

log = logging.getLogger(__name__)
ADAPTER_CONFIG = "adapter_config.json"
MODEL_DIR = "model"  # inside a full-weight version's folder: the model folder the engine loads
# Base-model files a full-weight version's model folder takes from the base: what the engine
# needs beside the weights (config, tokenizer, chat template), never weights or their index.
BASE_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")
JOB_ERROR_PREFIX = "rollout: "  # the job-record errors this service sets (and may clear)


@dataclass
class Loaded:
    """One version of a job's policy as the engine serves it (version 0: the base model)."""

    version: int
    adapter: Adapter | None = None
    folder: Path | None = None
    in_flight: int = 0  # requests submitted on this version and not finished yet
    probe: dict[str, list] = field(default_factory=dict)  # to re-check after an engine restart
    full: bool = False  # full weights: the engine's base model is `folder / MODEL_DIR`


@dataclass
class JobView:
    rec: JobRecord
    current: Loaded = field(default_factory=lambda: Loaded(0))
    retiring: list[Loaded] = field(default_factory=list)  # replaced, unloaded once drained
    failed: dict[int, str] = field(default_factory=dict)  # version -> why it was refused
    blocked: str = ""  # why its newest (full-weight) version cannot be adopted now; retried later

    @property
    def version(self) -> int:
        return self.current.version

    def loaded_adapters(self) -> int:
        return int(self.current.adapter is not None) + sum(1 for x in self.retiring if x.adapter)


def refusal_kind(e: Exception) -> str:
    """The metric label of a refused version: probe, hash, load, or manifest (a missing file
    or a malformed manifest)."""
    if isinstance(e, ProbeMismatch):
        return "probe"
    if isinstance(e, VerificationError):
        return "hash"
    if isinstance(e, AdapterError):
        return "load"
    return "manifest"


def sampling_of(spec: JobSpec, n: int | None = None, temperature: float | None = None) -> SamplingConfig:
    s = spec.sampling
    return SamplingConfig(
        n=n or spec.group_size,
        temperature=s.temperature if temperature is None else temperature,
        top_p=s.top_p if temperature is None else 1.0,
        max_tokens=s.max_tokens,
        # Stop strings of the job (SamplingSpec.stop); vLLM leaves them out of the text.
        stop=tuple(s.stop),
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class RolloutWorker:
    def __init__(self, rt: ServiceRuntime, settings: RolloutSettings, engine: Engine, store: ObjectStore) -> None:
        self.rt, self.s, self.engine, self.store = rt, settings, engine, store
        self.bus = Bus(
            rt.redis,
            keys.GROUP_ROLLOUT,
            settings.replica,
            heartbeat_role="rollout",
            claim_idle_ms=int(settings.claim_idle_s * 1000),
        )
        self.jobs: dict[str, JobView] = {}
        self.cache = settings.data_dir / "adapters" / f"{settings.replica}-{uuid.uuid4().hex[:6]}"
        self.engine_ok = True
        self._attempts: dict[tuple[str, int], int] = {}  # (job, version) -> adoption attempts
        # The job whose full weights the engine serves as its base model (None: the pool's
        # base model). While set, this pool serves that job only.
        self.full_owner: str | None = None
        self.refused: dict[str, str] = {}  # job -> why this pool does not serve it (or its versions) now
        reg = rt.registry
        self.m_tokens = Counter("burstrl_rollout_tokens", "Completion tokens generated", registry=reg)
        self.m_groups = Counter("burstrl_rollout_groups", "Groups produced", registry=reg)
        self.m_tps = Gauge("burstrl_rollout_tokens_per_second", "Generated tokens/s (last window)", registry=reg)
        self.m_idle = Gauge("burstrl_rollout_idle_fraction", "Wall time not in the engine (last window)", registry=reg)
        self.m_inflight = Gauge("burstrl_rollout_requests_in_flight", "Prompts submitted to the engine", registry=reg)
        self.m_version = Gauge("burstrl_rollout_policy_version", "Version serving new requests", ["job"], registry=reg)
        self.m_adapters = Gauge("burstrl_rollout_adapters_loaded", "Adapters in the engine", ["job"], registry=reg)
        self.m_adopt = Histogram(
            "burstrl_rollout_adopt_seconds",
            "Publish (manifest written) -> adopt (verified, serving) latency",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=reg,
        )
        self.m_adopt_last = Gauge(
            "burstrl_rollout_adopt_last_seconds", "Latest publish -> adopt", ["job"], registry=reg
        )
        self.m_verify_fail = Counter(
            "burstrl_rollout_verify_failures", "Refused policy versions", ["job", "kind"], registry=reg
        )
        self.m_job_refused = Gauge(
            "burstrl_rollout_job_refused",
            "1 while this pool cannot serve a job or its versions (full weights need a pool of their own)",
            ["job"],
            registry=reg,
        )
        self._win_t0, self._win_busy, self._win_tokens = time.time(), 0.0, 0
        load_env_plugins(settings.env_plugin_modules)  # fail at start, in the service, if one is missing
        self._env_stats: dict[str, list[Episode]] = {}  # episodes of the last round, per job
        self.m_env_turns = Counter("burstrl_rollout_env_turns", "Model turns in env episodes", registry=reg)
        self.m_env_tools = Counter("burstrl_rollout_env_tool_calls", "Tool calls in env episodes", registry=reg)
        self.m_env_tool_err = Counter("burstrl_rollout_env_tool_errors", "Failed tool calls", registry=reg)
        self.m_env_ends = Counter("burstrl_rollout_env_episodes", "Env episodes by end", ["end"], registry=reg)

    @property
    def probe_tolerance(self) -> float:
        if self.s.probe_tolerance is not None:
            return self.s.probe_tolerance
        return 0.01 if getattr(self.engine, "dtype", "unknown") == "float32" else 0.25

    # -- engine health ---------------------------------------------------------------
    def _engine_down(self, e: Exception) -> None:
        self.engine_ok = False
        self.rt.health.set("engine", False, str(e))

    def engine_ready(self) -> bool:
        if self.engine_ok:
            return True
        try:
            self.engine.check()
        except EngineError as e:
            self.rt.health.set("engine", False, str(e))
            return False
        try:
            self._reload_adapters()
        except (EngineError, AdapterError, ProbeMismatch) as e:
            self.rt.health.set("engine", False, f"engine back, but reloading adapters failed: {e}")
            return False
        self.engine_ok = True
        # Our own entries left pending by the outage: redone on the next read, not after
        # the bus's idle timeout.
        self.bus.redo_now()
        self.rt.health.set("engine", True)
        return True

    def _reload_adapters(self) -> None:
        """After an outage, load each job's current adapter again (new name) and re-probe it.

        A remote server that restarted has forgotten runtime-loaded adapters, and may even
        serve other weights now (another quantization): the probe says whether it still
        serves what the trainer published. A network blip only costs a reload.
        """
        for view in self.jobs.values():
            self._reap(view)
            cur = view.current
            if cur.folder is None:  # version 0: the base model, nothing to load
                continue
            if cur.full:
                # The engine's base weights are this version's (a remote engine never gets
                # here: it refuses full weights); re-probe that it still serves them.
                if cur.probe:
                    got = self.engine.prompt_logprobs(list(cur.probe["token_ids"]), None)
                    check_probe(cur.probe, got, self.probe_tolerance)
                continue
            if cur.adapter is not None:
                self.engine.unload(cur.adapter)
                cur.adapter = None  # until reloaded: a failure here is retried on the next check
            name = f"{view.rec.id}-policy-v{cur.version}-r{uuid.uuid4().hex[:4]}"
            adapter = self.engine.load_adapter(name, str(cur.folder.resolve()))
            try:
                if cur.probe:
                    check_probe(
                        cur.probe,
                        self.engine.prompt_logprobs(list(cur.probe["token_ids"]), adapter),
                        self.probe_tolerance,
                    )
            except BaseException:
                self.engine.unload(adapter)
                raise
            cur.adapter = adapter
            log.info("job %s: reloaded policy v%d as %s after an engine outage", view.rec.id, cur.version, name)

    # -- jobs and versions -----------------------------------------------------------
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
        if self.full_owner is not None and self.full_owner not in live:
            self._restore_base()  # before its folder goes: an in-place restore may need to go back to it
        if self.full_owner is not None:
            # The engine serves this job's full weights as its base model: any other job
            # would sample from them. Only the owner is served until it ends (and, should
            # restoring the base model have failed, no job at all).
            owner = self.full_owner
            for job_id in live - {owner}:
                self._refuse_job(
                    job_id,
                    f"this rollout pool serves the full weights of job {owner} (they replace its base model); "
                    "waiting until that job ends, or give full-weight jobs a rollout pool of their own",
                )
            live &= {owner}
        for gone in set(self.jobs) - live:
            view = self.jobs.pop(gone)
            for x in [view.current, *view.retiring]:
                self._drop(x)
            if gone not in self.refused:
                self.rt.health.set(f"policy:{gone}", True, "job no longer served", scope="job")
            for metric in (self.m_version, self.m_adapters, self.m_adopt_last):
                try:
                    metric.remove(gone)
                except KeyError:
                    pass
        for job_id in sorted(live):  # every served job first: a full-weight adoption checks who else is served
            view = self.jobs.setdefault(job_id, JobView(recs[job_id]))
            view.rec = recs[job_id]
            if job_id in self.refused and not view.blocked:
                self._accept_job(job_id)
        for job_id in sorted(live):
            view = self.jobs[job_id]
            self._reap(view)
            self.adopt_latest(view)
        for job_id in set(self.refused) - set(recs):  # refused jobs that ended: forget them
            self.refused.pop(job_id)
            self.rt.health.set(f"policy:{job_id}", True, "job no longer served", scope="job")
            try:
                self.m_job_refused.remove(job_id)
            except KeyError:
                pass
        for job_id, view in self.jobs.items():
            self.m_version.labels(job_id).set(view.version)
            self.m_adapters.labels(job_id).set(view.loaded_adapters())
        self.rt.gauges["policy_versions"] = {j: v.version for j, v in self.jobs.items()}

    def _drop(self, loaded: Loaded) -> None:
        if loaded.adapter is not None:
            self.engine.unload(loaded.adapter)
        if loaded.folder is not None:
            shutil.rmtree(loaded.folder, ignore_errors=True)

    def _reap(self, view: JobView) -> None:
        """Unload replaced versions whose requests have all finished."""
        keep = []
        for old in view.retiring:
            if old.in_flight > 0:
                keep.append(old)
            else:
                self._drop(old)
                log.info("job %s: unloaded policy v%d (drained)", view.rec.id, old.version)
        view.retiring = keep

    def adopt_latest(self, view: JobView) -> None:
        """Adopt the newest published version not yet refused (a few attempts per call)."""
        pointer = read_pointer(self.rt.redis, view.rec.id)
        attempts = 0
        for v in range(pointer, view.version, -1):
            if v in view.failed:
                continue
            room = self._room(view)
            if attempts == 3 or room is None or not self.engine_ok:
                return
            attempts += 1
            adopted = self._adopt(view, v, swap=room == "swap")
            if adopted is None:  # not now (full weights waiting for the pool or for drains)
                return
            if adopted:
                return

    def _room(self, view: JobView) -> str | None:
        """How a new adapter fits under the cap of max_staleness + 1 per job.

        "side": load it beside the current one; "swap": the cap is 1 (max_staleness 0) and
        the current one is idle, so unload it first (and reload it if the new one fails);
        None: wait until replaced versions drain.
        """
        cap = view.rec.spec.max_staleness + 1
        if view.loaded_adapters() + 1 <= cap:
            return "side"
        if not any(x.adapter for x in view.retiring) and view.current.in_flight == 0:
            return "swap"
        log.info("job %s: %d adapters loaded (cap %d); waiting for drains", view.rec.id, view.loaded_adapters(), cap)
        return None

    def _adopt(self, view: JobView, v: int, *, swap: bool = False) -> bool | None:
        """True: v serves now; False: v refused (the caller may try an older one); None: v
        cannot be adopted yet (a full-weight version waiting for drains or for the pool)."""
        job_id = view.rec.id
        try:
            # Only the names, unverified, to pick the path: LoRA or full weights. A full-weight
            # version that cannot be served here is refused before its weights are downloaded.
            names = self._version_files(job_id, v)
        except (StoreError, ValueError, KeyError, TypeError) as e:
            self._refuse(view, v, "manifest", f"{type(e).__name__}: {e}")
            return False
        if ADAPTER_CONFIG not in names:
            return self._adopt_full(view, v)
        dest = self.cache / job_id / f"policy-v{v}"  # fresh folder per version, never reused
        shutil.rmtree(dest, ignore_errors=True)
        adapter: Adapter | None = None
        swapped_out = False
        try:
            manifest = fetch_version(self.store, job_id, v, dest)  # sha256 of every file
            if ADAPTER_CONFIG not in manifest.files:
                raise ValueError(f"v{v}: manifest changed while reading it (no {ADAPTER_CONFIG} now)")
            if swap and view.current.adapter is not None:
                self.engine.unload(view.current.adapter)
                swapped_out = True
            # A new name per attempt too: a retried version must not meet its earlier self.
            tries = self._attempts[(job_id, v)] = self._attempts.get((job_id, v), 0) + 1
            name = f"{job_id}-policy-v{v}" + (f"-a{tries}" if tries > 1 else "")
            adapter = self.engine.load_adapter(name, str(dest.resolve()))
            worst = self._probe(manifest, adapter)
        except (VerificationError, StoreError, AdapterError, ValueError, KeyError, TypeError) as e:
            kind = refusal_kind(e)
            self._undo(view, dest, adapter, swapped_out)
            self._refuse(view, v, kind, f"{type(e).__name__}: {e}")
            return False
        except EngineError as e:  # the engine is away: not the version's fault, retry later
            self._undo(view, dest, adapter, swapped_out)
            self._engine_down(e)
            return False
        except BaseException:  # anything else (store outage, ...): leave nothing half-loaded
            self._undo(view, dest, adapter, swapped_out)
            raise
        old = view.current
        view.current = Loaded(v, adapter, dest, probe=manifest.probe)
        if swapped_out:
            old.adapter = None  # already unloaded; only its folder is left to delete
        if old.adapter is not None or old.folder is not None:
            view.retiring.append(old)
        self._reap(view)
        self._adopted(view, v, manifest, worst)
        return True

    def _version_files(self, job_id: str, v: int) -> list[str]:
        meta = json.loads(self.store.get(f"{version_prefix(job_id, v)}/{MANIFEST}"))
        return [str(n) for n in meta["files"]]

    def _adopt_full(self, view: JobView, v: int) -> bool | None:
        """Adopt full-weight version v: switch the engine's base weights, probe, or switch back."""
        job_id = view.rec.id
        if not getattr(self.engine, "full_weights", False):
            self._refuse(
                view,
                v,
                "unsupported",
                f"v{v} is full weights (no {ADAPTER_CONFIG}), which the {self.engine.mode} engine cannot load: a "
                "remote server's base weights are fixed when it starts; serve this job from an in-process rollout pool",
            )
            return False
        others = sorted(j for j in self.jobs if j != job_id)
        if others:
            self._refuse_job(
                job_id,
                f"policy v{v} is full weights, which replace the engine's base model, but this rollout pool also "
                f"serves {', '.join(others)}; give full-weight jobs a rollout pool of their own (waiting; still "
                f"serving v{view.version})",
                block=True,
            )
            return None
        if view.blocked:
            self._accept_job(job_id)
        if view.current.in_flight or any(x.in_flight for x in view.retiring):
            # Requests leased to the current weights finish on them first (never in this
            # single-threaded worker between engine calls, but the lease is the rule).
            log.info("job %s: full-weight v%d waits for in-flight requests", job_id, v)
            return None
        dest = self.cache / job_id / f"policy-v{v}"  # fresh folder per version, never reused
        shutil.rmtree(dest, ignore_errors=True)
        prev = view.current
        prev_model = str((prev.folder / MODEL_DIR).resolve()) if prev.full and prev.folder else None
        switched = False
        try:
            try:
                manifest = fetch_version(self.store, job_id, v, dest)  # sha256 of every file
                model_dir = self._model_folder(dest, manifest)
                switched = True  # from here on the engine may hold neither the old nor the new weights
                self.engine.load_full(str(model_dir.resolve()))
                worst = self._probe(manifest, None)
            except (VerificationError, StoreError, AdapterError, ValueError, KeyError, TypeError, OSError) as e:
                kind = refusal_kind(e)
                if switched and not isinstance(e, AdapterError):  # AdapterError: the engine put them back
                    self.engine.load_full(prev_model)
                shutil.rmtree(dest, ignore_errors=True)
                self._refuse(view, v, kind, f"{type(e).__name__}: {e}")
                return False
            except BaseException:
                if switched:
                    self.engine.load_full(prev_model)
                raise
        except EngineError as e:  # lost the engine (a restart failed both ways): not the version's fault
            shutil.rmtree(dest, ignore_errors=True)
            self._engine_down(e)
            return False
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        # The engine restarted or reloaded: adapters of the replaced versions are gone.
        for old in [*view.retiring, prev]:
            self._drop(old)  # an adapter a restart already dropped: unloading it is a no-op
        view.retiring = []
        view.current = Loaded(v, None, dest, probe=manifest.probe, full=True)
        self.full_owner = job_id
        self._adopted(view, v, manifest, worst)
        return True

    def _model_folder(self, dest: Path, manifest: Manifest) -> Path:
        """`dest/model`: the base model's config and tokenizer files + the version's weights.

        The base's config, not the version's: the pool is configured for that architecture
        and dtype (a GPU trainer saves its config with torch_dtype bfloat16)."""
        base = self._base_dir()
        model = dest / MODEL_DIR
        model.mkdir()
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(BASE_SKIP_SUFFIXES):
                shutil.copyfile(f, model / f.name)
        weights = [n for n in manifest.files if n.endswith((".safetensors", ".safetensors.index.json"))]
        if not any(n.endswith(".safetensors") for n in weights):
            raise ValueError(f"v{manifest.version}: full-weight version without *.safetensors")
        for name in weights:
            os.link(dest / name, model / name)  # same disk: no copy of the weights
        return model

    def _base_dir(self) -> Path:
        """The base model's local folder (a hub id: its cached snapshot, config and tokenizer only)."""
        if Path(self.s.model).is_dir():
            return Path(self.s.model)
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]
        try:
            return Path(snapshot_download(self.s.model, allow_patterns=patterns, local_files_only=True))
        except Exception:  # not cached yet: fetch the small files
            try:
                return Path(snapshot_download(self.s.model, allow_patterns=patterns))
            except Exception as e:  # not the version's fault: retried once the engine check passes
                raise EngineError(f"base model files of {self.s.model!r} unavailable: {type(e).__name__}: {e}") from e

    def _restore_base(self) -> None:
        """The full-weight job ended: serve the pool's base model again, so other jobs can be served."""
        try:
            self.engine.load_full(None)
        except (EngineError, AdapterError) as e:  # other jobs stay refused until this works
            self._engine_down(EngineError(f"restoring the base model after job {self.full_owner}: {e}"))
            return
        log.info("job %s ended: engine serves the base model %s again", self.full_owner, self.s.model)
        self.full_owner = None

    def _refuse_job(self, job_id: str, reason: str, *, block: bool = False) -> None:
        """This pool does not serve `job_id` (or its full-weight versions) now: say so everywhere."""
        if block and job_id in self.jobs:
            self.jobs[job_id].blocked = reason
        if self.refused.get(job_id) == reason:
            return
        self.refused[job_id] = reason
        self.m_job_refused.labels(job_id).set(1)
        self.rt.health.set(f"policy:{job_id}", False, reason, scope="job")
        self._set_job_error(job_id, JOB_ERROR_PREFIX + reason)
        log.error("job %s: %s", job_id, reason)

    def _accept_job(self, job_id: str) -> None:
        if job_id in self.jobs:
            self.jobs[job_id].blocked = ""
        if self.refused.pop(job_id, None) is None:
            return
        self.m_job_refused.labels(job_id).set(0)
        self.rt.health.set(f"policy:{job_id}", True, scope="job")
        self._set_job_error(job_id, "")
        log.info("job %s: served by this rollout pool again", job_id)

    def _adopted(self, view: JobView, v: int, manifest: Manifest, worst: float | None) -> None:
        job_id = view.rec.id
        adopt_s = time.time() - manifest.created_at
        self.m_adopt.observe(adopt_s)
        self.m_adopt_last.labels(job_id).set(adopt_s)
        self.rt.health.set(f"policy:{job_id}", True, scope="job")
        try:  # the switch is done; a Redis outage must not undo it, only lose this report
            self._set_job_error(job_id, "")
            record_point(
                self.rt.redis,
                job_id,
                "rollout_version",
                {"event": "adopted", "version": v, "adopt_s": round(adopt_s, 3), "probe_mean_diff": worst},
            )
        except redis.RedisError as e:
            log.warning("job %s: adopted v%d but could not record it: %s", job_id, v, e)
        log.info("job %s: adopted policy v%d (%.2fs after publish, probe diff %s)", job_id, v, adopt_s, worst)

    def _undo(self, view: JobView, dest: Path, adapter: Adapter | None, swapped_out: bool) -> None:
        """Back out of a failed adoption; the current version keeps serving."""
        if adapter is not None:
            self.engine.unload(adapter)
        shutil.rmtree(dest, ignore_errors=True)
        cur = view.current
        if swapped_out and cur.adapter is not None and cur.folder is not None:
            # Reload the old version from its verified folder under a new name (never reuse one).
            cur.adapter = self.engine.load_adapter(
                f"{cur.adapter.name}-r{uuid.uuid4().hex[:4]}", str(cur.folder.resolve())
            )

    def _probe(self, manifest: Manifest, adapter: Adapter | None) -> float | None:
        if not manifest.probe:
            if self.s.require_probe:
                raise ProbeMismatch("manifest has no log-prob probe (BURSTRL_ROLLOUT_REQUIRE_PROBE=1)")
            return None
        got = self.engine.prompt_logprobs(list(manifest.probe["token_ids"]), adapter)
        return check_probe(manifest.probe, got, self.probe_tolerance)

    def _refuse(self, view: JobView, v: int, kind: str, reason: str) -> None:
        job_id = view.rec.id
        view.failed[v] = reason
        self.m_verify_fail.labels(job_id, kind).inc()
        msg = f"policy v{v} refused ({kind}): {reason}; still serving v{view.version}"
        self.rt.health.set(f"policy:{job_id}", False, msg, scope="job")
        record_point(
            self.rt.redis,
            job_id,
            "rollout_version",
            {"event": "refused", "version": v, "kind": kind, "reason": reason, "serving": view.version},
        )
        self._set_job_error(job_id, JOB_ERROR_PREFIX + msg)
        log.error("job %s: %s", job_id, msg)

    def _set_job_error(self, job_id: str, error: str) -> None:
        """Show a refusal on the job record (GET /v1/jobs/{id}); clear only errors we set."""

        def change(rec: JobRecord) -> bool:
            if rec.error == error or (not error and not rec.error.startswith(JOB_ERROR_PREFIX)):
                return False
            rec.error = error
            return True

        update_job(self.rt.redis, job_id, change)

    # -- leases: which version a request runs on --------------------------------------
    def _lease(self, view: JobView) -> Loaded:
        cur = view.current
        cur.in_flight += 1
        self.m_inflight.inc()
        return cur

    def _release(self, view: JobView, loaded: Loaded) -> None:
        loaded.in_flight -= 1
        self.m_inflight.dec()
        if loaded is not view.current:
            self._reap(view)

    def _run(self, batch: list[tuple[str, JobView]], cfg: SamplingConfig) -> list[tuple[Loaded, object]]:
        """Generate for (prompt, job) pairs, each on the version current at submission."""
        leases = [(view, self._lease(view)) for _, view in batch]
        t0 = time.time()
        try:
            gens = self.engine.generate([p for p, _ in batch], [x.adapter for _, x in leases], cfg)
        finally:
            for view, x in leases:
                self._release(view, x)
            self._win_busy += time.time() - t0
        return [(x, g) for (_, x), g in zip(leases, gens, strict=True)]

    def _run_episodes(
        self, batch: list[tuple[str, dict[str, str], JobView]], cfg: SamplingConfig, n: int
    ) -> list[tuple[Loaded, list[Episode]]]:
        """n multi-turn episodes per (prompt, fields, job), all turns on the version leased at
        submission (the lease keeps its adapter loaded until the last turn is done)."""
        groups = [
            [new_episode(view.rec.spec, p, f, None, cfg, self.s.max_model_len) for _ in range(n)]
            for p, f, view in batch
        ]  # EnvError (unknown env, bad args) raises before anything is leased
        leases = [(view, self._lease(view)) for _, _, view in batch]
        for (_, x), eps in zip(leases, groups, strict=True):
            for ep in eps:
                ep.adapter = x.adapter
        t0 = time.time()
        try:
            run_episodes(self.engine, [ep for eps in groups for ep in eps])
        finally:
            for view, x in leases:
                self._release(view, x)
            self._win_busy += time.time() - t0
        stuck = stuck_env_calls()
        if stuck >= self.s.max_stuck_env_calls:
            self.rt.health.set("env", False, f"{stuck} environment calls hang past their deadline; restart rollout")
        else:
            self.rt.health.set("env", True)
        for eps in groups:
            for ep in eps:
                self.m_env_turns.inc(ep.turns)
                self.m_env_tools.inc(ep.tool_calls)
                self.m_env_tool_err.inc(ep.tool_errors)
                self.m_env_ends.labels(ep.end).inc()
        return [(x, eps) for (_, x), eps in zip(leases, groups, strict=True)]

    # -- evaluation ------------------------------------------------------------------
    def evaluate_pending(self) -> None:
        """Held-out evaluation of each adopted version, once across all replicas."""
        r = self.rt.redis
        for view in list(self.jobs.values()):
            spec, v = view.rec.spec, view.version
            if spec.eval_size == 0 or r.hexists(keys.evals(view.rec.id), str(v)):
                continue
            if not r.set(keys.eval_claim(view.rec.id, v), self.s.replica, nx=True, ex=600):
                continue
            try:
                result = self._evaluate(view)
            except BaseException:
                r.delete(keys.eval_claim(view.rec.id, v))  # let another try rather than wait 10 min
                raise
            record_eval(r, view.rec.id, result.pop("version_evaluated"), result)
            log.info(
                "job %s v%d held-out: pass@1 %.3f pass@%d %.3f greedy %.3f",
                view.rec.id,
                v,
                result["pass@1"],
                self.s.eval_samples,
                result[f"pass@{self.s.eval_samples}"],
                result["greedy_accuracy"],
            )

    def _evaluate(self, view: JobView) -> dict:
        spec = view.rec.spec
        task = task_for_job(spec)
        items = task.heldout_items(spec.eval_size)
        prompts = [(it.prompt, view) for it in items]
        t0 = time.time()
        k = self.s.eval_samples
        if spec.env.name:
            return self._evaluate_episodes(view, task, items, t0)
        sampled = self._run(prompts, sampling_of(spec, n=k))
        greedy = self._run(prompts, sampling_of(spec, n=1, temperature=0.0))
        versions = {x.version for x, _ in sampled} | {x.version for x, _ in greedy}
        if len(versions) != 1:  # cannot happen with one engine call per set, but never mix versions
            raise RuntimeError(f"evaluation spanned versions {versions}")
        rewards, correct = [], []
        for (_, g), it in zip(sampled, items, strict=True):
            rs = [total(task.score(s.text, it.fields)) for s in g.samples]
            rewards.extend(rs)
            correct.append(sum(x >= 1.0 for x in rs))
        greedy_ok = [
            total(task.score(g.samples[0].text, it.fields)) >= 1.0 for (_, g), it in zip(greedy, items, strict=True)
        ]
        p1 = sum(pass_at_k(k, c, 1) for c in correct) / len(items)
        return {
            "version_evaluated": versions.pop(),
            "accuracy": p1,  # kept for older readers: the same as pass@1
            "pass@1": p1,
            f"pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / len(items),
            "mean_reward": sum(rewards) / len(rewards),
            "greedy_accuracy": sum(greedy_ok) / len(greedy_ok),
            "n_prompts": len(items),
            "samples_per_prompt": k,
            "seconds": round(time.time() - t0, 2),
        }

    def _evaluate_episodes(self, view: JobView, task: object, items: list, t0: float) -> dict:
        """Held-out evaluation of a multi-turn job: whole episodes, scored as the reward
        service scores them (the task's verifier on the final answer + the env's parts)."""
        spec, k = view.rec.spec, self.s.eval_samples
        batch = [(it.prompt, dict(it.fields), view) for it in items]
        sampled = self._run_episodes(batch, sampling_of(spec, n=k), k)
        greedy = self._run_episodes(batch, sampling_of(spec, n=1, temperature=0.0), 1)
        versions = {x.version for x, _ in sampled} | {x.version for x, _ in greedy}
        if len(versions) != 1:
            raise RuntimeError(f"evaluation spanned versions {versions}")

        def verified(ep: Episode, fields: dict[str, str]) -> float:
            return total(task.score(ep.answer, fields))  # type: ignore[attr-defined]

        rewards, correct = [], []
        for (_, eps), it in zip(sampled, items, strict=True):
            rs = [verified(ep, it.fields) for ep in eps]
            rewards.extend(r + sum(ep.parts.values()) for r, ep in zip(rs, eps, strict=True))
            correct.append(sum(x >= 1.0 for x in rs))
        greedy_ok = [verified(eps[0], it.fields) >= 1.0 for (_, eps), it in zip(greedy, items, strict=True)]
        p1 = sum(pass_at_k(k, c, 1) for c in correct) / len(items)
        st = episode_stats([ep for _, eps in sampled for ep in eps])
        return {
            "version_evaluated": versions.pop(),
            "accuracy": p1,
            "pass@1": p1,
            f"pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / len(items),
            "mean_reward": sum(rewards) / len(rewards),
            "greedy_accuracy": sum(greedy_ok) / len(greedy_ok),
            "n_prompts": len(items),
            "samples_per_prompt": k,
            "turns_mean": st["turns_mean"],
            "tool_calls_mean": st["tool_calls_mean"],
            "tool_errors": st["tool_errors"],
            "length_mean": st["length_mean"],
            "seconds": round(time.time() - t0, 2),
        }

    def _env_group(self, msg: PromptMsg, loaded: Loaded, eps: list[Episode], now: float) -> GroupMsg:
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

    # -- generation ------------------------------------------------------------------
    def _read(self, streams: list[str]) -> list[Entry]:
        return self.bus.read(streams, count=self.s.prompts_per_batch, block_ms=500)

    def generate_once(self) -> dict[str, dict[str, float]]:
        """One engine round over the served jobs' prompts; stats per job."""
        running = {j: v for j, v in self.jobs.items() if v.rec.state == JobState.running}
        entries = self._read([keys.prompts(j) for j in running])
        if not entries:
            return {}
        # The feeder tops prompts up right after the trainer acknowledges a step, i.e. just
        # after it published a version: adopt that version before generating, or the batch
        # is sampled a version behind and the trainer may drop it as stale (the demo lost
        # ~28% of its groups this way).
        for job_id in {e.job_id for e in entries} & set(running):
            self.adopt_latest(running[job_id])
        todo: list[tuple[Entry, PromptMsg, JobView]] = []
        for e, msg in self.bus.decode(entries, PromptMsg):
            view = running.get(e.job_id)
            if view is None:
                self.bus.dead_letter(e, "job is not served by this rollout pool")
                continue
            todo.append((e, msg, view))
        # One engine call per sampling config; jobs differ in G and sampling settings.
        # Jobs with the same config share a call: vLLM batches their adapters side by side.
        # Multi-turn (env) jobs run as episodes, apart from single-turn ones.
        by_cfg: dict[tuple[SamplingConfig, bool], list[tuple[Entry, PromptMsg, JobView]]] = {}
        for t in todo:
            spec = t[2].rec.spec
            by_cfg.setdefault((sampling_of(spec), bool(spec.env.name)), []).append(t)
        stats: dict[str, dict[str, float]] = {}
        self._env_stats = {}
        for (cfg, multi), batch in by_cfg.items():
            try:
                if multi:
                    try:
                        episodes = self._run_episodes([(m.prompt, dict(m.fields), v) for _, m, v in batch], cfg, cfg.n)
                    except EnvError as err:  # unknown env or bad args: the job's config, not the service
                        for e, _, _ in batch:
                            self.bus.dead_letter(e, f"environment: {err}")
                        continue
                else:
                    results = self._run([(m.prompt, v) for _, m, v in batch], cfg)
            except EngineError as err:
                # Entries stay pending (unacked): replayed once the engine is back.
                self._engine_down(err)
                return stats
            now = time.time()
            # Settled in one pipelined round trip per batch (each group still atomically and
            # at most once): a round trip per group cost ~15% of tokens/s on a small model.
            units: list[tuple[Entry, list[tuple[str, bytes]], dict[str, int]]] = []
            if multi:
                for (e, msg, _), (loaded, eps) in zip(batch, episodes, strict=True):
                    group = self._env_group(msg, loaded, eps, now)
                    units.append((e, [(keys.rollouts(msg.job_id), encode(group))], {"produced": 1}))
                    tokens = sum(ep.generated_tokens for ep in eps)
                    self.m_tokens.inc(tokens)
                    self._win_tokens += tokens
                    self._env_stats.setdefault(msg.job_id, []).extend(eps)
                    st = stats.setdefault(msg.job_id, {"groups": 0, "tokens": 0, "samples": 0, "truncated": 0})
                    st["groups"] += 1
                    st["tokens"] += tokens
                    st["samples"] += len(eps)
                    st["truncated"] += sum(ep.finish_reason == "length" for ep in eps)
                self.bus.settle(units)
                continue
            for (e, msg, _), (loaded, gen) in zip(batch, results, strict=True):
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
                tokens = sum(len(s.token_ids) for s in gen.samples)
                self.m_tokens.inc(tokens)
                self._win_tokens += tokens
                st = stats.setdefault(msg.job_id, {"groups": 0, "tokens": 0, "samples": 0, "truncated": 0})
                st["groups"] += 1
                st["tokens"] += tokens
                st["samples"] += len(gen.samples)
                st["truncated"] += sum(s.finish_reason == "length" for s in gen.samples)
            self.bus.settle(units)
        self.m_groups.inc(sum(s["groups"] for s in stats.values()))
        return stats

    def _window(self) -> None:
        """Tokens/s and idle fraction over ~10 s windows (Prometheus also has rate() of the counters)."""
        elapsed = time.time() - self._win_t0
        if elapsed < 10:
            return
        self.m_tps.set(self._win_tokens / elapsed)
        self.m_idle.set(max(0.0, 1.0 - self._win_busy / elapsed))
        self._win_t0, self._win_busy, self._win_tokens = time.time(), 0.0, 0

    def tick(self) -> None:
        self._window()
        if not self.engine_ready():
            self.rt.stop.wait(self.s.engine_retry_s)
            return
        self.refresh_jobs()
        try:
            self.evaluate_pending()
        except EngineError as e:
            self._engine_down(e)
            return
        t0 = time.time()
        stats = self.generate_once()
        seconds = round(time.time() - t0, 3)
        for job_id, st in stats.items():
            point = {
                "groups": st["groups"],
                "seconds": seconds,
                "tokens": st["tokens"],
                "tokens_per_s": round(st["tokens"] / seconds, 1) if seconds > 0 else 0.0,
                "truncated_frac": round(st["truncated"] / max(1, st["samples"]), 4),
                "version": self.jobs[job_id].version if job_id in self.jobs else None,
            }
            record_point(self.rt.redis, job_id, "rollout", point)
            if job_id in self._env_stats:  # turns, tool calls and errors, episode length
                env_point = episode_stats(self._env_stats[job_id])
                env_point["version"] = point["version"]
                record_point(self.rt.redis, job_id, "rollout_env", env_point)

    def close(self) -> None:
        for view in self.jobs.values():
            for x in [view.current, *view.retiring]:
                self._drop(x)
        shutil.rmtree(self.cache, ignore_errors=True)
