"""What a rollout pool serves: per job, the version new requests run on, the replaced ones
still draining, the refused ones; and the lease every request holds on one version.

A request is leased to the version current when it was submitted and is tagged with it
(docs/architecture.md, invariant 6). A replaced version stays loaded while any lease on it
is held, then is unloaded and its folder deleted (`Leases.reap`). A held-out evaluation
holds one lease across all its rounds, so the version it evaluates stays loaded until its
last sample, however many versions are adopted meanwhile.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from services.rollout.engine import Adapter, Engine, Generation, Prompt, SamplingConfig
from services.rollout.episodes import Episode, new_episode, run_episodes
from services.rollout.errors import RequestFailed
from services.rollout.prompts import PromptRenderer
from shared.job import JobRecord, JobSpec

log = logging.getLogger(__name__)


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


@dataclass
class ServedVersion:
    """One version of a job's policy as the engine serves it (version 0: the base model)."""

    version: int
    adapter: Adapter | None = None
    folder: Path | None = None
    in_flight: int = 0  # leases held: requests (and an evaluation) submitted on it, not finished yet
    probe: dict[str, list] = field(default_factory=dict)  # to re-check after an engine restart
    full: bool = False  # full weights: the engine's base model is `folder / MODEL_DIR`


@dataclass
class Refusal:
    """Why a version was refused, and which manifest was refused: a republished version
    (another manifest) is tried again, an unchanged one is not."""

    manifest_id: str  # sha256 of the manifest's bytes ("missing" when there was none)
    kind: str  # the metric label (services/rollout/errors.py)
    reason: str
    checked_at: float = field(default_factory=time.monotonic)  # when its manifest was last looked at


@dataclass
class ServedJob:
    rec: JobRecord
    current: ServedVersion = field(default_factory=lambda: ServedVersion(0))
    retiring: list[ServedVersion] = field(default_factory=list)  # replaced, unloaded once drained
    refused: dict[int, Refusal] = field(default_factory=dict)  # version -> why (and which manifest)
    blocked: str = ""  # why its newest (full-weight) version cannot be adopted now; retried later
    evaluating: ServedVersion | None = None  # the version a held-out evaluation holds a lease on

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def version(self) -> int:
        return self.current.version

    def loaded_adapters(self) -> int:
        return int(self.current.adapter is not None) + sum(1 for x in self.retiring if x.adapter)

    def adapter_cap(self) -> int:
        """Adapters the job may hold: max_staleness + 1 for generation, plus one for the
        version an evaluation holds, so an evaluation never delays an adoption."""
        return (
            self.rec.spec.max_staleness + 1 + int(self.evaluating is not None and self.evaluating.adapter is not None)
        )


class Leases:
    """The one way requests reach the engine: each on the version its lease names."""

    def __init__(self, engine: Engine, registry: CollectorRegistry, context: int, model: str = "") -> None:
        self.engine = engine
        self.context = context  # the engine's context length (episodes stay within it)
        self.prompts = PromptRenderer(engine, model)  # `model`: the base model folder served
        self.busy_s = 0.0  # seconds spent in engine calls (the idle-fraction window reads it)
        self.m_inflight = Gauge(
            "burstrl_rollout_requests_in_flight", "Prompts submitted to the engine", registry=registry
        )

    # -- leases ----------------------------------------------------------------------
    def take(self, view: ServedJob) -> ServedVersion:
        cur = view.current
        cur.in_flight += 1
        self.m_inflight.inc()
        return cur

    def release(self, view: ServedJob, x: ServedVersion) -> None:
        x.in_flight -= 1
        self.m_inflight.dec()
        if x is not view.current:
            self.reap(view)

    def reap(self, view: ServedJob) -> None:
        """Unload replaced versions whose leases have all been given back."""
        keep = []
        for old in view.retiring:
            if old.in_flight > 0:
                keep.append(old)
            else:
                self.drop(old)
                log.info("job %s: unloaded policy v%d (drained)", view.id, old.version)
        view.retiring = keep

    def drop(self, x: ServedVersion) -> None:
        if x.adapter is not None:
            self.engine.unload(x.adapter)
        if x.folder is not None:
            shutil.rmtree(x.folder, ignore_errors=True)

    # -- engine calls ----------------------------------------------------------------
    def generate(
        self, batch: list[tuple[str, ServedJob]], cfg: SamplingConfig
    ) -> list[tuple[ServedVersion, Generation]]:
        """Generate for (prompt, job) pairs, each leased to the job's current version for the call."""
        inputs = self.render([(p, view.rec.spec) for p, view in batch])  # RequestFailed: before leases
        leases = [(view, self.take(view)) for _, view in batch]
        try:
            gens = self.generate_on([(p, x) for p, (_, x) in zip(inputs, leases, strict=True)], cfg)
        finally:
            for view, x in leases:
                self.release(view, x)
        return [(x, g) for (_, x), g in zip(leases, gens, strict=True)]

    def render(self, batch: list[tuple[str, JobSpec]]) -> list[Prompt]:
        """Jobs' prompt texts as the engine's inputs (services/rollout/prompts.py)."""
        return self.prompts.render(batch)

    def generate_on(self, batch: list[tuple[Prompt, ServedVersion]], cfg: SamplingConfig) -> list[Generation]:
        """Generate for (rendered prompt, version) pairs; the caller holds the leases."""
        t0 = time.time()
        try:
            return self.engine.generate([p for p, _ in batch], [x.adapter for _, x in batch], cfg)
        finally:
            self.busy_s += time.time() - t0

    def episodes(
        self, batch: list[tuple[str, dict[str, str], ServedJob]], cfg: SamplingConfig, n: int
    ) -> list[tuple[ServedVersion, list[Episode]]]:
        """n multi-turn episodes per (prompt, fields, job), on the version current at submission."""
        groups = [self.new_episodes(p, f, view.rec.spec, cfg, n) for p, f, view in batch]  # EnvError: before leases
        leases = [(view, self.take(view)) for _, _, view in batch]
        try:
            self.run_on([(x, eps) for (_, x), eps in zip(leases, groups, strict=True)], n)
        finally:
            for view, x in leases:
                self.release(view, x)
        return [(x, eps) for (_, x), eps in zip(leases, groups, strict=True)]

    def new_episodes(
        self, prompt: str, fields: dict[str, str], spec: object, cfg: SamplingConfig, n: int
    ) -> list[Episode]:
        """n fresh episodes of a job's environment on one prompt (EnvError: unknown env, bad args)."""
        return [new_episode(spec, prompt, fields, None, cfg, self.context) for _ in range(n)]

    def run_on(self, groups: list[tuple[ServedVersion, list[Episode]]], n: int) -> None:
        """Run groups of n episodes to their ends, all turns on the version each group holds
        a lease on (the lease keeps its adapter loaded until the last turn is done).
        A RequestFailed's index names the group, not the episode."""
        for x, eps in groups:
            for ep in eps:
                ep.adapter = x.adapter
        t0 = time.time()
        try:
            run_episodes(self.engine, [ep for _, eps in groups for ep in eps])
        except RequestFailed as e:
            e.index = None if e.index is None else e.index // n
            raise
        finally:
            self.busy_s += time.time() - t0
