"""Adopting a job's policy versions: load, verify, switch, or undo (docs/architecture.md,
"Weight sync" and invariant 5).

LoRA version N:
1. its manifest is read once; its sha256 is the version's identity here (a refusal holds
   for that manifest only: a republished version is tried again, an unchanged one is not);
2. the files are downloaded into a fresh folder and checked against the manifest's sha256s
   and against the trainer fence (a deposed trainer's version is refused);
3. loaded under a NEW adapter name (`{job}-policy-vN`, `-aK` on a retry);
4. probed: the engine's per-token log-probs of the manifest's probe sequence must match
   the trainer's within `probe_tolerance`;
5. new requests switch to it; the previous version is unloaded once its leases are given
   back (services/rollout/served.py).
A version failing 1-4 never serves: the job keeps its last good version and the refusal is
reported (services/rollout/reporting.py).

Full-weight versions (no adapter_config.json) replace the engine's base model: once no
lease is held on the job, the version's safetensors and the base model's config/tokenizer
files make a fresh model folder the engine switches to (`Engine.load_full`), then the probe
runs under the new base weights; a failed probe switches back. Every other job would then
sample from those weights, so a full-weight version is adopted only while the pool serves no
other job, and while it serves one, other jobs are refused. A remote engine refuses them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import time
from pathlib import Path

from services.rollout.engine import Adapter, Engine
from services.rollout.errors import (
    LORA_HELP,
    AdapterError,
    EngineUnavailable,
    ManifestError,
    ProbeMismatch,
    RequestFailed,
    UnsupportedVersion,
    VersionRefused,
    refusal_kind,
)
from services.rollout.reporting import Reporter
from services.rollout.served import Leases, Refusal, ServedJob, ServedVersion
from services.rollout.settings import RolloutSettings
from shared.policy import MANIFEST, Manifest, check_probe, fetch_version, parse_manifest, read_pointer, version_prefix
from shared.service import ServiceRuntime
from shared.store import ObjectStore, StoreError

log = logging.getLogger(__name__)
ADAPTER_CONFIG = "adapter_config.json"
MODEL_DIR = "model"  # inside a full-weight version's folder: the model folder the engine loads
# Base-model files a full-weight version's model folder takes from the base: what the engine
# needs beside the weights (config, tokenizer, chat template), never weights or their index.
BASE_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")
MAX_TRIES_PER_CALL = 3  # versions tried per adopt_latest call: a run of bad ones cannot stall the loop
# The probe's default tolerance (mean per-token |engine - trainer| log-prob difference) by the
# engine's dtype. An fp32 engine agrees with the fp32 trainer to ~1e-5 (SmolLM2: 6e-6..9e-6 at
# adoption, 2.9e-5 on its worst token; the tiny model likewise), while one optimizer step of the
# SmolLM2 demo (LoRA, lr 2e-4) moves the probe by 4e-3..1e-2 (median 6.5e-3; docs/smollm2.md): under 0.01
# the probe passed an engine serving the previous version's weights. 1e-3 keeps 100x over the
# engine's error and refuses a version one such step stale. Other dtypes carry their own error
# (the tiny model in bf16: right adapter <= 0.05, wrong one >= 0.28; SmolLM2 in bf16 0.04-0.05).
FP32_PROBE_TOLERANCE = 1e-3
OTHER_PROBE_TOLERANCE = 0.25


def probe_tolerance_for(dtype: str) -> float:
    """The probe tolerance an engine computing in `dtype` gets unless one is set."""
    return FP32_PROBE_TOLERANCE if dtype == "float32" else OTHER_PROBE_TOLERANCE


class Adopter:
    def __init__(
        self,
        rt: ServiceRuntime,
        settings: RolloutSettings,
        engine: Engine,
        store: ObjectStore,
        leases: Leases,
        reporter: Reporter,
        jobs: dict[str, ServedJob],
        cache: Path,
    ) -> None:
        self.rt, self.s, self.engine, self.store = rt, settings, engine, store
        self.leases, self.reporter, self.jobs, self.cache = leases, reporter, jobs, cache
        self._attempts: dict[tuple[str, int], int] = {}  # (job, version) -> adoption attempts
        # Reloads of a served version (after a failed swap, or a probe) get `-r{n}`: a name this
        # engine never had, by construction (a random suffix could repeat one).
        self._reloads = itertools.count(1)
        # The job whose full weights the engine serves as its base model (None: the pool's
        # base model). While set, this pool serves that job only.
        self.full_owner: str | None = None

    @property
    def probe_tolerance(self) -> float:
        if self.s.probe_tolerance is not None:
            return self.s.probe_tolerance
        return probe_tolerance_for(getattr(self.engine, "dtype", "unknown"))

    # -- choosing a version ----------------------------------------------------------
    def adopt_latest(self, view: ServedJob) -> None:
        """Adopt the newest published version not refused (a few attempts per call).

        A refused version is looked at again every `refusal_recheck_s` (one small GET of its
        manifest) and tried again only if its manifest changed."""
        pointer = read_pointer(self.rt.redis, view.id)
        tries = 0
        for v in range(pointer, view.version, -1):
            old = view.refused.get(v)
            if old is not None and time.monotonic() - old.checked_at < self.s.refusal_recheck_s:
                continue
            room = self._room(view)
            if tries == MAX_TRIES_PER_CALL or room is None:
                return
            manifest_id, raw = self._manifest_bytes(view.id, v)
            if old is not None:
                old.checked_at = time.monotonic()
                if old.manifest_id == manifest_id:
                    continue
                log.info("job %s: v%d has a new manifest since it was refused; trying it again", view.id, v)
            tries += 1
            adopted = self._adopt(view, v, manifest_id, raw, swap=room == "swap")
            if adopted is None or adopted:  # None: not now (full weights waiting for the pool or drains)
                return

    def _room(self, view: ServedJob) -> str | None:
        """How a new adapter fits under the job's cap (ServedJob.adapter_cap).

        "side": load it beside the current one; "swap": the cap is full, but the current
        adapter is idle and no other replaced one is loaded, so unload it first (and reload
        it if the new one fails); None: wait until replaced versions drain.
        """
        cap = view.adapter_cap()
        if view.loaded_adapters() + 1 <= cap:
            return "side"
        draining = [x for x in view.retiring if x.adapter is not None and x is not view.evaluating]
        if not draining and view.current.in_flight == 0:
            return "swap"
        log.info("job %s: %d adapters loaded (cap %d); waiting for drains", view.id, view.loaded_adapters(), cap)
        return None

    def _manifest_bytes(self, job_id: str, v: int) -> tuple[str, bytes | None]:
        """(identity, bytes) of version v's manifest; ("missing", None) when there is none."""
        try:
            raw = self.store.get(f"{version_prefix(job_id, v)}/{MANIFEST}")
        except StoreError:  # the stores raise it for a missing object (an outage raises their own errors)
            return "missing", None
        return hashlib.sha256(raw).hexdigest(), raw

    def _adopt(self, view: ServedJob, v: int, manifest_id: str, raw: bytes | None, *, swap: bool) -> bool | None:
        """True: v serves now; False: v refused (the caller may try an older one); None: v
        cannot be adopted yet (a full-weight version waiting for drains or for the pool)."""
        key = f"{version_prefix(view.id, v)}/{MANIFEST}"
        try:
            if raw is None:
                raise ManifestError(f"{key}: no such object (the version is being written, or was deleted)")
            manifest = parse_manifest(raw, key)
        except ManifestError as e:
            self._refuse(view, v, manifest_id, e)
            return False
        if ADAPTER_CONFIG not in manifest.files:
            return self._adopt_full(view, manifest_id, manifest)
        return self._adopt_lora(view, manifest_id, manifest, swap=swap)

    # -- LoRA ------------------------------------------------------------------------
    def _adopt_lora(self, view: ServedJob, manifest_id: str, manifest: Manifest, *, swap: bool) -> bool:
        job_id, v = view.id, manifest.version
        suffix, dest = self._fresh(job_id, v)
        adapter: Adapter | None = None
        swapped_out = False
        try:
            fetch_version(self.store, job_id, v, dest, manifest=manifest)  # sha256 of every file, the fence
            if swap and view.current.adapter is not None:
                self.engine.unload(view.current.adapter)
                swapped_out = True
            adapter = self.engine.load_adapter(f"{job_id}-policy-v{v}{suffix}", str(dest.resolve()))
            worst = self._probe(manifest, adapter)
        except VersionRefused as e:
            self._undo(view, dest, adapter, swapped_out)
            self._refuse(view, v, manifest_id, e)
            return False
        except BaseException:  # the engine went away, a store outage, a bug: leave nothing half-loaded
            self._undo(view, dest, adapter, swapped_out)
            raise
        old = view.current
        view.current = ServedVersion(v, adapter, dest, probe=manifest.probe)
        if swapped_out:
            old.adapter = None  # already unloaded; only its folder is left to delete
        if old.adapter is not None or old.folder is not None:
            view.retiring.append(old)
        self.leases.reap(view)
        self._adopted(view, manifest, worst)
        return True

    def _fresh(self, job_id: str, v: int) -> tuple[str, Path]:
        """A new suffix and an empty folder per attempt at a version (`policy-vN`, then
        `policy-vN-aK`): an adapter name or path is never reused, else vLLM may serve stale
        weights or prefix-cache blocks, and a retried version must not meet its earlier self."""
        tries = self._attempts[(job_id, v)] = self._attempts.get((job_id, v), 0) + 1
        suffix = f"-a{tries}" if tries > 1 else ""
        dest = self.cache / job_id / f"policy-v{v}{suffix}"
        shutil.rmtree(dest, ignore_errors=True)
        return suffix, dest

    def _undo(self, view: ServedJob, dest: Path, adapter: Adapter | None, swapped_out: bool) -> None:
        """Back out of a failed adoption; the current version keeps serving."""
        if adapter is not None:
            self.engine.unload(adapter)
        shutil.rmtree(dest, ignore_errors=True)
        cur = view.current
        if swapped_out and cur.adapter is not None and cur.folder is not None:
            # Reload the old version from its verified folder under a new name (never reuse one).
            cur.adapter = self.engine.load_adapter(
                f"{cur.adapter.name}-r{next(self._reloads)}", str(cur.folder.resolve())
            )

    # -- full weights ----------------------------------------------------------------
    def _adopt_full(self, view: ServedJob, manifest_id: str, manifest: Manifest) -> bool | None:
        """Adopt a full-weight version: switch the engine's base weights, probe, or switch back."""
        job_id, v = view.id, manifest.version
        if not getattr(self.engine, "full_weights", False):
            why = (
                f"v{v} is full weights (no {ADAPTER_CONFIG}), which the {self.engine.mode} engine cannot load: a "
                "remote server's base weights are fixed when it starts; serve this job from an in-process rollout pool"
            )
            self._refuse(view, v, manifest_id, UnsupportedVersion(why))
            return False
        others = sorted(j for j in self.jobs if j != job_id)
        if others:
            self.refuse_job(
                job_id,
                f"policy v{v} is full weights, which replace the engine's base model, but this rollout pool also "
                f"serves {', '.join(others)}; give full-weight jobs a rollout pool of their own (waiting; still "
                f"serving v{view.version})",
                block=True,
            )
            return None
        if view.blocked:
            self.accept_job(job_id)
        if view.current.in_flight or any(x.in_flight for x in view.retiring):
            # Leases on the current weights (an evaluation's, say) are given back first: the
            # switch replaces the weights under every adapter of the job.
            log.info("job %s: full-weight v%d waits for in-flight requests", job_id, v)
            return None
        _, dest = self._fresh(job_id, v)
        prev = view.current
        prev_model = str((prev.folder / MODEL_DIR).resolve()) if prev.full and prev.folder else None
        switched = False
        try:
            try:
                fetch_version(self.store, job_id, v, dest, manifest=manifest)  # sha256 of every file, the fence
                model_dir = self._model_folder(dest, manifest)
                switched = True  # from here on the engine may hold neither the old nor the new weights
                self.engine.load_full(str(model_dir.resolve()))
                worst = self._probe(manifest, None)
            except VersionRefused as e:
                if switched and not isinstance(e, AdapterError):  # AdapterError: the engine put them back
                    self.engine.load_full(prev_model)
                shutil.rmtree(dest, ignore_errors=True)
                self._refuse(view, v, manifest_id, e)
                return False
            except BaseException:
                if switched:
                    self.engine.load_full(prev_model)
                raise
        except BaseException:  # the engine lost (a restart failed both ways), a store outage, a bug
            shutil.rmtree(dest, ignore_errors=True)
            raise
        # The engine restarted or reloaded: adapters of the replaced versions are gone.
        for old in [*view.retiring, prev]:
            self.leases.drop(old)  # an adapter a restart already dropped: unloading it is a no-op
        view.retiring = []
        view.current = ServedVersion(v, None, dest, probe=manifest.probe, full=True)
        self.full_owner = job_id
        self._adopted(view, manifest, worst)
        return True

    def _model_folder(self, dest: Path, manifest: Manifest) -> Path:
        """`dest/model`: the base model's config and tokenizer files + the version's weights.

        The base's config, not the version's: the pool is configured for that architecture
        and dtype (a GPU trainer saves its config with torch_dtype bfloat16)."""
        weights = [n for n in manifest.files if n.endswith((".safetensors", ".safetensors.index.json"))]
        if not any(n.endswith(".safetensors") for n in weights):
            raise ManifestError(f"v{manifest.version}: full-weight version without *.safetensors")
        base = self._base_dir()
        model = dest / MODEL_DIR
        model.mkdir()
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(BASE_SKIP_SUFFIXES):
                shutil.copyfile(f, model / f.name)
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
                raise EngineUnavailable(
                    f"base model files of {self.s.model!r} unavailable: {type(e).__name__}: {e}"
                ) from e

    def restore_base(self) -> None:
        """The full-weight job ended: serve the pool's base model again, so other jobs can be served.
        Raises EngineUnavailable when that fails (other jobs stay refused until it works)."""
        try:
            self.engine.load_full(None)
        except (EngineUnavailable, AdapterError) as e:
            raise EngineUnavailable(f"restoring the base model after job {self.full_owner}: {e}") from e
        log.info("job %s ended: engine serves the base model %s again", self.full_owner, self.s.model)
        self.full_owner = None

    # -- after an engine outage ------------------------------------------------------
    def reload_after_outage(self) -> None:
        """Load each job's current adapter again (new name) and re-probe it.

        A remote server that restarted has forgotten runtime-loaded adapters, and may even
        serve other weights now (another quantization): the probe says whether it still
        serves what the trainer published. A network blip only costs a reload.
        """
        for view in self.jobs.values():
            self.leases.reap(view)
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
            name = f"{view.id}-policy-v{cur.version}-r{next(self._reloads)}"
            adapter = self.engine.load_adapter(name, str(cur.folder.resolve()))
            try:
                if cur.probe:
                    got = self.engine.prompt_logprobs(list(cur.probe["token_ids"]), adapter)
                    check_probe(cur.probe, got, self.probe_tolerance)
            except BaseException:
                self.engine.unload(adapter)
                raise
            cur.adapter = adapter
            log.info("job %s: reloaded policy v%d as %s after an engine outage", view.id, cur.version, name)

    # -- verdicts --------------------------------------------------------------------
    def _probe(self, manifest: Manifest, adapter: Adapter | None) -> float | None:
        """The probe's mean difference; a refusal under an adapter says whether the engine's LoRA
        path is what failed (the base model answering where the adapter does not, or the adapter
        changing nothing): no LoRA kernel is verified on every card (gfx906: deploy/README.md)."""
        if not manifest.probe:
            if self.s.require_probe:
                raise ProbeMismatch("manifest has no log-prob probe (BURSTRL_ROLLOUT_REQUIRE_PROBE=1)")
            return None
        ids = list(manifest.probe["token_ids"])
        try:
            got = self.engine.prompt_logprobs(ids, adapter)
        except RequestFailed as e:
            if adapter is None or self._base_logprobs(ids) is None:
                raise
            why = "the engine answers the same probe under the base model: the adapter, or its LoRA path, fails here"
            raise type(e)(f"{e}; {why}; {LORA_HELP}", e.index) from e
        try:
            return check_probe(manifest.probe, got, self.probe_tolerance)
        except ProbeMismatch as e:
            base = self._base_logprobs(ids) if adapter is not None else None
            if base is None or not (why := _unapplied(manifest.probe["logprobs"], got, base, self.probe_tolerance)):
                raise
            raise ProbeMismatch(f"{e}; {why}; {LORA_HELP}") from e

    def _base_logprobs(self, ids: list[int]) -> list[float] | None:
        """The probe's log-probs under the base model, or None if the engine refuses that too."""
        try:
            return self.engine.prompt_logprobs(ids, None)
        except RequestFailed:
            return None

    def _adopted(self, view: ServedJob, manifest: Manifest, worst: float | None) -> None:
        view.refused = {k: x for k, x in view.refused.items() if k > manifest.version}  # out of reach now
        self.reporter.adopted(view, manifest, worst)

    def _refuse(self, view: ServedJob, v: int, manifest_id: str, e: BaseException) -> None:
        kind, reason = refusal_kind(e), f"{type(e).__name__}: {e}"
        view.refused[v] = Refusal(manifest_id, kind, reason)
        self.reporter.refused(view, v, kind, reason)

    def refuse_job(self, job_id: str, reason: str, *, block: bool = False) -> None:
        """This pool does not serve `job_id` now; `block`: it is served, but its newest
        (full-weight) version waits (ServedJob.blocked)."""
        if block and job_id in self.jobs:
            self.jobs[job_id].blocked = reason
        self.reporter.job_refused(job_id, reason)

    def accept_job(self, job_id: str) -> None:
        if job_id in self.jobs:
            self.jobs[job_id].blocked = ""
        self.reporter.job_accepted(job_id)


def _unapplied(want: list[float], got: list[float], base: list[float], tolerance: float) -> str:
    """Why a probe under an adapter failed, when the engine's log-probs are the base model's
    while the trainer's are not: the engine did not apply the adapter ("" otherwise)."""
    if not len(want) == len(got) == len(base):
        return ""
    moved = sum(abs(g - b) for g, b in zip(got, base, strict=True)) / len(base)
    wanted = sum(abs(w - b) for w, b in zip(want, base, strict=True)) / len(base)
    if moved > tolerance / 10 or wanted <= tolerance:
        return ""
    return (
        f"under the adapter the engine's log-probs are the base model's (mean gap {moved:.2g}) while the trainer's "
        f"differ from them by {wanted:.2g}: the engine did not apply the adapter"
    )
