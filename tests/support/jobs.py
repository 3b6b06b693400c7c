"""The small LoRA job most trainer tests run: rank 4, one step of staleness, a name the test picks.

One builder, so the tests that fill a window, cut a store or kill a trainer all describe their job
the same way, and a new required field of JobSpec is added in one place."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from shared.job import JobRecord, JobSpec, JobState, insert_job


def small_spec(base_model: str | Path, *, name: str, group: int, batch: int, steps: int, **fields: object) -> JobSpec:
    """A LoRA job (rank 4, alpha 8, max_staleness 1 unless `fields` says otherwise) on `base_model`."""
    values: dict[str, object] = {"max_staleness": 1, "lora_rank": 4, "lora_alpha": 8, **fields}
    return JobSpec(name=name, base_model=str(base_model), group_size=group, batch_size=batch, steps=steps, **values)


def fresh_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model built for this module (hidden 64, 2 layers, seed 0): untrained, built in well
    under a second, for tests about the trainer's plumbing rather than what it learns."""
    from shared.ml.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, seed=0)


def insert_running(r: redis.Redis, job_id: str, spec: JobSpec) -> JobRecord:
    """Write `spec` under `job_id` as a running job (as the api would, without its feeder)."""
    now = time.time()
    rec = JobRecord(id=job_id, spec=spec, state=JobState.running, created_at=now, updated_at=now)
    insert_job(r, rec)
    return rec


def arith_job(name: str, *, group: int, batch: int, steps: int, **fields: object) -> dict[str, object]:
    """The body of a POST /v1/jobs for the tiny model's `arith` task, as the end-to-end tests send it:
    completions of at most 6 tokens at T=1, one version of staleness, no held-out evaluation unless
    `fields` asks (they override any of these)."""
    return {
        "name": name,
        "task": "arith",
        "group_size": group,
        "batch_size": batch,
        "steps": steps,
        "max_staleness": 1,
        "eval_size": 0,
        "sampling": {"temperature": 1.0, "max_tokens": 6},
        **fields,
    }
