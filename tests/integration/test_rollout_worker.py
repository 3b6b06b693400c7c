"""The rollout worker's version logic with a fake engine (fast, tests/support/fake_engine.py):
drain-then-unload, the adapter cap, refusals, republished and deposed versions, replicas sharing a
consumer group, engine outages, evaluation and pass@k, hanging verifiers. Full-weight versions:
test_rollout_full_weights.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.cli.launch import free_port
from services.rollout.errors import EngineRequestRefused
from services.rollout.evaluation import pass_at_k
from services.rollout.worker import RolloutWorker
from shared import keys
from shared.bus import FIELD
from shared.folders import folder_file
from shared.job import load_job
from shared.metrics import read_ledger, read_points
from shared.schema import GroupMsg, PromptMsg, decode, decode_dead, encode
from tests.support.fake_engine import CountingStore, fake_version, feed, good, worker_factory
from tests.support.plugins import plugin_module
from tests.support.rollout import add_job, corrupt, engine_not_ready, publish, republish, rollout_service


@pytest.fixture
def env(tmp_path: Path, redis_server, r):  # noqa: ANN001, ANN201
    store = CountingStore(tmp_path / "store")
    return worker_factory(tmp_path, redis_server.url, store), store, r


def evaluate(w: RolloutWorker, job_id: str, version: int | None = None, timeout: float = 60.0) -> dict:
    """Run evaluation rounds until the result for `version` (default: the current one) is recorded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w.evaluator.step(w.jobs)
        v = w.jobs[job_id].version if version is None else version
        got = w.rt.redis.hget(keys.evals(job_id), str(v))
        if got is not None:
            return json.loads(got)
        time.sleep(0.02)
    raise AssertionError(f"no evaluation of job {job_id} within {timeout}s")


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 1, 2) == pytest.approx(0.5)


def _serving_v1(env, **spec: object) -> tuple:  # noqa: ANN001
    """A new job (no evaluation, `spec` on top) whose v1 the worker adopted: the worker, its
    engine and HTTP client, the job, the store and Redis."""
    make, store, r = env
    w, eng, http = make()
    job = add_job(r, "tiny", **{"eval_size": 0, **spec})
    publish(store, r, job.id, 1, *good(1))
    w.refresh_jobs()
    return w, eng, http, job, store, r


def test_drain_before_unload_and_adapter_cap(env) -> None:  # noqa: ANN001
    w, eng, _, job, store, r = _serving_v1(env, max_staleness=1)
    view = w.jobs[job.id]
    v1 = w.leases.take(view)  # a request in flight on v1
    publish(store, r, job.id, 2, *good(2))
    w.refresh_jobs()
    assert view.version == 2 and [x.version for x in view.retiring] == [1]
    assert set(eng.loaded) == {f"{job.id}-policy-v1", f"{job.id}-policy-v2"}
    # Cap: max_staleness + 1 = 2 adapters; v3 waits until v1's request finishes.
    publish(store, r, job.id, 3, *good(3))
    w.refresh_jobs()
    assert view.version == 2
    w.leases.release(view, v1)  # v1 drained -> unloaded at once
    assert set(eng.loaded) == {f"{job.id}-policy-v2"} and v1.folder and not v1.folder.exists()
    w.refresh_jobs()
    assert view.version == 3 and set(eng.loaded) == {f"{job.id}-policy-v3"}


def test_refusals_keep_old_version_and_show_everywhere(env) -> None:  # noqa: ANN001
    w, eng, http, job, store, r = _serving_v1(env, max_staleness=0)  # cap 1: the swap path
    publish(store, r, job.id, 2, *good(2))
    corrupt(store, job.id, 2)
    publish(store, r, job.id, 3, *fake_version([-1.0, -2.0, -3.0], probe_lp=[-1.0, -2.0, -3.5]))
    publish(store, r, job.id, 4, *fake_version([0.0], probe_lp=[0.0]))
    store.put(folder_file(store, f"jobs/{job.id}/policy/v4", "adapter_model.safetensors"), b"{}")  # hash-checked away
    publish(store, r, job.id, 5, {"adapter_model.safetensors": b'{"bad": 1}', "adapter_config.json": b"{}"}, {})
    for _ in range(3):
        w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 1 and view.loaded_adapters() == 1
    assert sorted(view.refused) == [2, 3, 4, 5]
    assert view.refused[3].kind == "probe" and "ProbeMismatch" in view.refused[3].reason
    ready = http.get("/readyz")  # a job's problem, not the service's: degraded but ready
    assert ready.status_code == 200 and ready.json()["degraded"]
    assert "still serving v1" in ready.json()["checks"][f"policy:{job.id}"]["reason"]
    assert "refused" in load_job(r, job.id).error
    # v1 was swapped out for each try and back in under a new name: still serves.
    feed(r, job.id, 1)
    w.tick()
    (_, f), *_ = r.xrange(keys.rollouts(job.id))
    assert decode(f[FIELD], GroupMsg).policy_version == 1
    assert len(eng.loaded) == 1
    publish(store, r, job.id, 6, *good(6))
    w.refresh_jobs()
    assert view.version == 6 and http.get("/readyz").status_code == 200 and load_job(r, job.id).error == ""


def test_replicas_share_one_consumer_group(env) -> None:  # noqa: ANN001
    make, store, r = env
    w1, e1, _ = make("r1")
    w2, e2, _ = make("r2")
    job = add_job(r, "tiny", eval_size=0, group_size=2)
    feed(r, job.id, 12)
    for _ in range(3):
        w1.tick()
        w2.tick()
    groups = [decode(f[FIELD], GroupMsg) for _, f in r.xrange(keys.rollouts(job.id))]
    assert sorted(g.group_id for g in groups) == sorted(f"{job.id}:g{i}" for i in range(12))  # each once
    assert e1.calls and e2.calls  # both replicas worked
    assert read_ledger(r, job.id)["produced"] == 12
    assert r.xpending(keys.prompts(job.id), keys.GROUP_ROLLOUT)["pending"] == 0


def test_engine_outage_loses_nothing(env) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make()
    job = add_job(r, "tiny", eval_size=0)
    feed(r, job.id, 3)
    eng.down = True
    w.tick()
    ready = http.get("/readyz")
    assert ready.status_code == 503 and "unreachable" in ready.json()["checks"]["engine"]["reason"]
    assert r.xpending(keys.prompts(job.id), keys.GROUP_ROLLOUT)["pending"] == 3  # unacked, not lost
    w.s.engine_retry_s = 0.01
    eng.down = False
    w.tick()  # engine back: ready, and our own pending entries are redone at once
    assert http.get("/readyz").status_code == 200
    assert read_ledger(r, job.id)["produced"] == 3
    assert r.xpending(keys.prompts(job.id), keys.GROUP_ROLLOUT)["pending"] == 0


def test_eval_pass_at_k_and_truncation_metrics(env) -> None:  # noqa: ANN001
    make, store, r = env
    w, _, http = make()
    job = add_job(r, "tiny", eval_size=4, group_size=2)
    w.refresh_jobs()
    evaluate(w, job.id)
    (raw,) = r.hvals(keys.evals(job.id))
    ev = json.loads(raw)
    assert ev["version"] == 0 and {"pass@1", "pass@4", "mean_reward", "greedy_accuracy"} <= set(ev)
    assert 0.0 <= ev["pass@1"] <= ev["pass@4"] <= 1.0
    feed(r, job.id, 2, prompt="1+2=x")  # odd length: truncated at max_tokens by the fake
    w.tick()
    (point,) = read_points(r, job.id, "rollout")
    assert point["truncated_frac"] == 1.0 and point["groups"] == 2
    text = http.get("/metrics").text
    assert f'burstrl_rollout_policy_version{{job="{job.id}"}} 0.0' in text
    assert "burstrl_rollout_requests_in_flight 0.0" in text


def test_service_stays_up_when_remote_engine_unreachable(tmp_path: Path, redis_server) -> None:  # noqa: ANN001
    env = {
        "BURSTRL_ROLLOUT_ENGINE": "remote",
        "BURSTRL_ROLLOUT_ENGINE_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "BURSTRL_ROLLOUT_ENGINE_RETRY_S": "0.5",
    }
    with rollout_service(tmp_path, redis_server.url, "tiny", **env) as (proc, port):
        engine_not_ready(port, "unreachable", 30, tmp_path / "rollout.log")
        time.sleep(1.5)  # it keeps retrying and stays up
        assert proc.poll() is None


def test_jobs_share_engine_calls_with_their_own_adapters(env) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, _ = make()
    a = add_job(r, "tiny", name="a", eval_size=0, group_size=2)
    b = add_job(r, "tiny", name="b", eval_size=0, group_size=2)
    publish(store, r, a.id, 1, *good(1))
    publish(store, r, b.id, 1, *good(2))
    w.refresh_jobs()
    feed(r, a.id, 1)
    feed(r, b.id, 1)
    w.tick()
    # One engine call, one adapter per job side by side (vLLM multi-LoRA batching).
    assert sorted(eng.calls[-1]) == sorted([f"{a.id}-policy-v1", f"{b.id}-policy-v1"])
    for job in (a, b):
        (_, f), *_ = r.xrange(keys.rollouts(job.id))
        assert decode(f[FIELD], GroupMsg).policy_version == 1


def test_engine_restart_reloads_and_reprobes_adapters(env) -> None:  # noqa: ANN001
    w, eng, http, job, store, r = _serving_v1(env)
    w.s.engine_retry_s = 0.01
    eng.loaded.clear()  # the server restarted and forgot its runtime-loaded adapters
    feed(r, job.id, 2)
    w.tick()
    assert http.get("/readyz").json()["checks"]["engine"]["ok"] is False
    w.tick()  # reachable again: v1 reloaded under a new name, re-probed, pending prompts redone
    assert http.get("/readyz").status_code == 200
    (name,) = eng.loaded
    assert name.startswith(f"{job.id}-policy-v1-r")
    assert read_ledger(r, job.id)["produced"] == 2
    groups = [decode(f[FIELD], GroupMsg) for _, f in r.xrange(keys.rollouts(job.id))]
    assert {g.policy_version for g in groups} == {1}


def _refusals(r, job_id: str) -> list[tuple[int, str]]:  # noqa: ANN001
    return [(p["version"], p["kind"]) for p in read_points(r, job_id, "rollout_version") if p["event"] == "refused"]


def test_a_republished_version_is_tried_again_an_unchanged_one_is_not(env) -> None:  # noqa: ANN001
    w, eng, http, job, store, r = _serving_v1(env)
    publish(store, r, job.id, 2, *good(2))
    corrupt(store, job.id, 2)
    w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 1 and view.refused[2].kind == "hash"
    weights = folder_file(store, f"jobs/{job.id}/policy/v2", "adapter_model.safetensors")
    manifest = f"jobs/{job.id}/policy/v2/manifest.json"
    reads = store.gets[weights]
    for _ in range(3):  # the same manifest: looked at again, never downloaded again
        w.refresh_jobs()
    assert store.gets[weights] == reads and _refusals(r, job.id) == [(2, "hash")]
    w.s.refusal_recheck_s = 3600.0  # and looked at only every refusal_recheck_s
    looked = store.gets[manifest]
    w.refresh_jobs()
    assert store.gets[manifest] == looked
    w.s.refusal_recheck_s = 0.0
    # The trainer repairs it (a new manifest): tried again, and adopted.
    republish(store, r, job.id, 2, *good(2))
    w.refresh_jobs()
    assert view.version == 2 and not view.refused and set(eng.loaded) == {f"{job.id}-policy-v2-a2"}
    assert http.get("/readyz").json()["checks"][f"policy:{job.id}"]["ok"] and load_job(r, job.id).error == ""


def test_a_deposed_trainers_version_is_refused_as_such_until_its_successor_publishes_it(env) -> None:  # noqa: ANN001
    from shared.fence import record_takeover

    make, store, r = env
    w, _, http = make()
    job = add_job(r, "tiny", eval_size=0)
    publish(store, r, job.id, 1, *good(1), epoch=1)
    w.refresh_jobs()
    # Trainer B took the job over (epoch 2) finding v1; the stalled trainer A (epoch 1) then wrote v2.
    record_takeover(store, job.id, 2, "trainer-b", version=1, checkpoint=-1)
    publish(store, r, job.id, 2, *good(2), epoch=1)
    w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 1 and view.refused[2].kind == "deposed" and "DeposedWrite" in view.refused[2].reason
    assert "v2 refused (deposed)" in http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    assert f'burstrl_rollout_verify_failures_total{{job="{job.id}",kind="deposed"}} 1.0' in http.get("/metrics").text
    republish(store, r, job.id, 2, *good(2), epoch=2)  # B publishes v2 itself
    w.refresh_jobs()
    assert view.version == 2 and _refusals(r, job.id) == [(2, "deposed")]


def test_a_bug_is_a_bug_and_a_refused_probe_request_refuses_the_version(env) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make()
    job = add_job(r, "tiny", eval_size=0)
    publish(store, r, job.id, 1, *good(1))
    eng.probe_error = KeyError("a bug in the probe code")
    with pytest.raises(KeyError):
        w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 0 and not view.refused and eng.loaded == {}  # nothing half-loaded, nothing refused
    w.rt.survive(w.tick, backoff_s=0)  # the service loop logs it with its traceback and counts it
    assert 'burstrl_errors_total{kind="worker"} 1.0' in http.get("/metrics").text
    assert _refusals(r, job.id) == []
    # A probe the engine refuses (a remote server's 4xx) refuses the version, labelled as the engine's.
    eng.probe_error = EngineRequestRefused("remote engine /v1/completions: HTTP 400: token id out of range", 0)
    w.refresh_jobs()
    assert view.version == 0 and view.refused[1].kind == "engine" and _refusals(r, job.id) == [(1, "engine")]
    # A malformed manifest is the manifest's.
    key = f"jobs/{job.id}/policy/v1/manifest.json"
    store.put(key, store.get(key).replace(b'"step"', b'"stpe"'))
    eng.probe_error = None
    w.refresh_jobs()
    assert view.refused[1].kind == "manifest" and "missing step" in view.refused[1].reason


def test_a_prompt_without_logprobs_makes_no_group_and_is_dead_lettered_with_the_reason(env) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, _ = make()
    w.bus.max_deliveries = 3
    w.bus.claim_idle_ms = 0  # redo pending entries at every read (the bus's reclaim pass)
    job = add_job(r, "tiny", eval_size=0, group_size=2)
    for i, prompt in enumerate(["1+2=", "2+2=", "3+2="]):
        msg = PromptMsg(job_id=job.id, group_id=f"{job.id}:g{i}", item_id=str(i), prompt=prompt)
        r.xadd(keys.prompts(job.id), {FIELD: encode(msg)})
    r.hincrby(keys.ledger(job.id), "fed", 3)
    eng.no_logprob_for = "2+2="
    for _ in range(6):
        w.tick()
    groups = [decode(f[FIELD], GroupMsg) for _, f in r.xrange(keys.rollouts(job.id))]
    assert sorted(g.group_id for g in groups) == [f"{job.id}:g0", f"{job.id}:g2"]  # its neighbours are produced
    (_, dead), *_ = r.xrange(keys.dead_letter(job.id))
    reason = decode_dead(dead[FIELD]).reason
    assert "MissingLogprob" in reason and "log-prob None" in reason and "delivered 3 times" in reason
    ledger = read_ledger(r, job.id)
    assert ledger["produced"] == 2 and ledger["dead"] == 1
    assert r.xpending(keys.prompts(job.id), keys.GROUP_ROLLOUT)["pending"] == 0


def test_evaluation_runs_in_rounds_and_never_holds_up_adoption(env) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, _ = make()
    w.s.eval_chunk = 4
    job = add_job(r, "tiny", eval_size=24, max_staleness=0, group_size=2)  # cap 1: only the evaluation's extra slot
    publish(store, r, job.id, 1, *good(1))
    w.refresh_jobs()
    view = w.jobs[job.id]
    w.evaluator.step(w.jobs)  # the evaluation of v1 starts: one round of 4 of its 24 prompts
    ev = w.evaluator.running[job.id]
    assert ev.version == 1 and ev.next == 4 and view.evaluating is view.current
    publish(store, r, job.id, 2, *good(2))
    feed(r, job.id, 1)
    w.tick()  # adopted at once, though v1's evaluation is under way
    assert view.version == 2 and ev.next == 8
    # v1 stays loaded (the evaluation holds its lease), and evaluation rounds keep using it.
    assert [x.version for x in view.retiring] == [1] and f"{job.id}-policy-v1" in eng.loaded
    v1, v2 = f"{job.id}-policy-v1", f"{job.id}-policy-v2"
    assert eng.calls[-3:] == [[v1] * 4, [v1] * 4, [v2]]  # the round (sampled, greedy) on v1, generation on v2
    (_, f), *_ = r.xrange(keys.rollouts(job.id))
    assert decode(f[FIELD], GroupMsg).policy_version == 2  # generation runs on the new version
    result = evaluate(w, job.id, version=1)
    assert result["n_prompts"] == 24 and result["version"] == 1
    assert f"{job.id}-policy-v1" not in eng.loaded and not view.retiring  # given back: unloaded
    result2 = evaluate(w, job.id)  # and then the current version is evaluated
    assert result2["version"] == 2


def test_a_hanging_verifier_costs_its_deadline_not_the_loop(env, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from shared.domain.tasks import task_for_job

    hang = (
        "import time\nfrom shared.domain.verifiers import register_verifier\n"
        "@register_verifier('hang_on_prompt')\n"
        "def hang(completions, prompt='', hang='', **_):\n"
        "    if prompt == hang and len(completions) > 1:  # its sampled answers, not its greedy one\n"
        "        time.sleep(600)\n"
        "    return [1.0] * len(completions)\n"
    )
    plugin_module(tmp_path, monkeypatch, "hang_on_prompt", hang)
    make, store, r = env
    w, eng, _ = make()
    w.evaluator.scorer.close()
    from shared.domain.scoring import Scorer

    w.evaluator.scorer = Scorer(1, ["hang_on_prompt"])  # a real scoring process, killed at its deadline
    spec = {"name": "h", "base_model": "tiny", "eval_size": 4}
    from shared.job import JobSpec

    stuck = task_for_job(JobSpec(**spec)).heldout_items(4)[1].prompt
    # A deadline no honest group misses, even with a scoring process to start on a loaded machine.
    ts = {"verifiers": [{"name": "hang_on_prompt", "args": {"hang": stuck}}], "timeout_s": 15.0}
    job = add_job(r, "tiny", name="h", eval_size=4, group_size=2, task_spec=ts)
    w.refresh_jobs()
    w.evaluator.step(w.jobs)  # one round: all 4 prompts generated, handed to the scorer
    assert not w.evaluator.generating
    publish(store, r, job.id, 1, *good(1))
    w.tick()  # the loop goes on while the verifier hangs: v1 is adopted meanwhile
    (rnd,) = w.evaluator.running[job.id].rounds
    assert w.jobs[job.id].version == 1 and not rnd.scores.done()
    result = evaluate(w, job.id, version=0, timeout=120)
    assert result["score_tags"] == {"verifier!timeout": 4}  # that prompt's 4 sampled answers
    assert result["pass@1"] == pytest.approx(0.75) and result["greedy_accuracy"] == 1.0
