"""The rollout worker's version logic with a fake engine (fast): drain-then-unload, the
adapter cap, refusals, replicas sharing a consumer group, engine outages, pass@k, and
full-weight versions (a pool of their own; refused by engines that cannot load them).

Over ~400 lines: the worker's contract (adoption, refusal, generation, eval, recovery) against one
real Redis and store fixture set.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.cli.launch import free_port
from services.rollout.engine import Adapter, Generation, Sample, SamplingConfig
from services.rollout.errors import AdapterError, EngineRequestRefused, EngineUnavailable, MissingLogprob
from services.rollout.evaluation import pass_at_k
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from shared import keys
from shared.bus import FIELD
from shared.folders import folder_file
from shared.job import load_job
from shared.metrics import read_ledger, read_points
from shared.schema import GroupMsg, PromptMsg, decode, decode_dead, encode
from shared.service import ServiceRuntime
from shared.store import FileStore
from tests.support.plugins import plugin_module
from tests.support.rollout import add_job, corrupt, engine_not_ready, publish, republish, rollout_service

PROBE_IDS = [5, 6, 7, 8]


BASE_LP = [-9.0, -9.0, -9.0]


class FakeEngine:
    """Serves 'adapters' (and full-weight model folders) whose probe log-probs are written in
    their weights file."""

    mode = "fake"
    dtype = "float32"

    def __init__(self, full_weights: bool = True) -> None:
        self.loaded: dict[str, list[float]] = {}
        self.names_seen: set[str] = set()
        self.ids = itertools.count(1)
        self.down = False
        self.calls: list[list[str | None]] = []
        self.full_weights = full_weights
        self.base_lp = BASE_LP  # what the base weights answer the probe with
        self.full_loads: list[str | None] = []  # load_full calls, in order
        self.probe_error: Exception | None = None  # raised by prompt_logprobs
        self.no_logprob_for = ""  # a prompt answered without log-probs (as a broken server would)

    def load_adapter(self, name: str, path: str) -> Adapter:
        assert name not in self.names_seen, f"adapter name {name} reused"
        self.names_seen.add(name)
        data = json.loads((Path(path) / "adapter_model.safetensors").read_bytes())
        if "bad" in data:
            raise AdapterError("not an adapter")
        self.loaded[name] = data["lp"]
        return Adapter(name, next(self.ids), path)

    def unload(self, adapter: Adapter) -> None:
        self.loaded.pop(adapter.name, None)

    def load_full(self, path: str | None) -> None:
        if not self.full_weights:
            raise AdapterError("fake remote engine: fixed base weights")
        self.full_loads.append(path)
        if path is None:
            self.base_lp = BASE_LP
        else:
            assert (Path(path) / "config.json").exists(), "the model folder lacks the base config"
            self.base_lp = json.loads((Path(path) / "model.safetensors").read_bytes())["lp"]
        self.loaded.clear()  # a restarted engine has no adapters

    def generate_ids(
        self, prompts: list[list[int]], adapters: list[Adapter | None], cfg: SamplingConfig
    ) -> list[Generation]:
        # As the engines do: the given ids are the prompt as is (multi-turn never re-tokenizes).
        gens = self.generate(["x" * len(p) for p in prompts], adapters, cfg)
        return [Generation(list(p), g.samples) for p, g in zip(prompts, gens, strict=True)]

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return ([1] if special else []) + [ord(c) % 250 + 2 for c in text]

    def has_chat_template(self) -> bool:
        return False  # jobs' prompts reach generate as text (prompt_format auto resolves to raw)

    def generate(self, prompts: list[str], adapters: list[Adapter | None], cfg: SamplingConfig) -> list[Generation]:
        if self.down:
            raise EngineUnavailable("fake engine unreachable")
        self.calls.append([a.name if a else None for a in adapters])
        for a in adapters:
            if a is not None and a.name not in self.loaded:  # as a restarted remote server answers
                raise EngineUnavailable(f"remote engine lost an adapter: {a.name}")
        # Odd-length prompts answer '3' (right for 1+2=), even ones are cut at max_tokens.
        out = []
        for i, p in enumerate(prompts):
            if p == self.no_logprob_for:
                raise MissingLogprob("sample: the engine returned log-prob None for token 0", i)
            text = "3" if len(p) % 2 == 0 else "9" * cfg.max_tokens
            reason = "stop" if len(p) % 2 == 0 else "length"
            out.append(
                Generation([1, 2], [Sample([3] * len(text), [-0.5] * len(text), text, reason) for _ in range(cfg.n)])
            )
        return out

    def prompt_logprobs(self, token_ids: list[int], adapter: Adapter | None) -> list[float]:
        if self.probe_error is not None:
            raise self.probe_error
        return self.loaded[adapter.name] if adapter else self.base_lp

    def check(self) -> None:
        if self.down:
            raise EngineUnavailable("fake engine unreachable")

    def close(self) -> None:
        pass


def fake_version(lp: list[float], probe_lp: list[float] | None = None) -> tuple[dict[str, bytes], dict]:
    files = {"adapter_model.safetensors": json.dumps({"lp": lp}).encode(), "adapter_config.json": b"{}"}
    return files, {"token_ids": PROBE_IDS, "logprobs": probe_lp if probe_lp is not None else lp}


def good(i: int) -> tuple[dict[str, bytes], dict]:
    return fake_version([-float(i)] * 3)


def fake_full(lp: list[float], probe_lp: list[float] | None = None) -> tuple[dict[str, bytes], dict]:
    """A full-weight version as `full_files` publishes it: weights + config, no adapter_config.json."""
    files = {"model.safetensors": json.dumps({"lp": lp}).encode(), "config.json": b'{"v": "trained"}'}
    return files, {"token_ids": PROBE_IDS, "logprobs": probe_lp if probe_lp is not None else lp}


class CountingStore(FileStore):
    """The real file store, counting the reads of each key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets: collections.Counter[str] = collections.Counter()

    def get(self, key: str) -> bytes:
        self.gets[key] += 1
        return super().get(key)


@pytest.fixture
def env(tmp_path: Path, redis_server, r):  # noqa: ANN001, ANN201
    store = CountingStore(tmp_path / "store")

    def make(
        replica: str = "r1", engine: FakeEngine | None = None, model: str = "tiny"
    ) -> tuple[RolloutWorker, FakeEngine, TestClient]:
        s = RolloutSettings(
            model=model,
            redis_url=redis_server.url,
            store_url=store.url,
            dev=True,
            data_dir=tmp_path / replica,
            replica=replica,
            prompts_per_batch=3,
            eval_samples=4,
            score_workers=0,  # threads: no scoring process to start for every test
            refusal_recheck_s=0.0,
        )
        rt = ServiceRuntime("rollout", s)
        rt.health.set("engine", True)
        eng = engine or FakeEngine()
        return RolloutWorker(rt, s, eng, store), eng, TestClient(rt.app)

    return make, store, r


def feed(r, job_id: str, n: int, prompt: str = "1+2=") -> None:  # noqa: ANN001
    for i in range(n):
        msg = PromptMsg(job_id=job_id, group_id=f"{job_id}:g{i}", item_id=str(i), prompt=prompt)
        r.xadd(keys.prompts(job_id), {FIELD: encode(msg)})
    r.hincrby(keys.ledger(job_id), "fed", n)


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


@pytest.fixture
def base_dir(tmp_path: Path) -> str:
    """A 'base model' folder: config and tokenizer files (and weights, which must not be copied)."""
    d = tmp_path / "base-model"
    d.mkdir()
    (d / "config.json").write_text('{"v": "base"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_text('{"lp": [-9.0, -9.0, -9.0]}')
    return str(d)


def _refused_metric(http: TestClient, job_id: str) -> str:
    (line,) = [
        x
        for x in http.get("/metrics").text.splitlines()
        if x.startswith(f'burstrl_rollout_job_refused{{job="{job_id}"}}')
    ]
    return line.rsplit(" ", 1)[1]


def test_full_weight_job_needs_a_pool_of_its_own(env, base_dir: str) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make(model=base_dir)
    lora = add_job(r, base_dir, name="lora", eval_size=0, group_size=2)
    full = add_job(r, base_dir, name="full", eval_size=0, group_size=2)
    publish(store, r, lora.id, 1, *good(1))
    publish(store, r, full.id, 1, *fake_full([-2.0, -2.0, -2.0]))
    w.refresh_jobs()
    # The full-weight version would replace the base model under the LoRA job: not adopted.
    assert w.jobs[full.id].version == 0 and w.jobs[lora.id].version == 1 and eng.full_loads == []
    reason = http.get("/readyz").json()["checks"][f"policy:{full.id}"]["reason"]
    assert "full weights" in reason and lora.id in reason and "pool of their own" in reason
    assert "pool of their own" in load_job(r, full.id).error
    assert _refused_metric(http, full.id) == "1.0"
    assert 1 not in w.jobs[full.id].refused  # waiting, not refused
    # ...and the LoRA job keeps being served on its adapter.
    feed(r, lora.id, 1)
    w.tick()
    (_, f), *_ = r.xrange(keys.rollouts(lora.id))
    assert decode(f[FIELD], GroupMsg).policy_version == 1
    # The LoRA job ends: the pool is the full job's alone now, v1 is adopted.
    r.srem(keys.active_jobs(), lora.id)
    w.refresh_jobs()
    view = w.jobs[full.id]
    assert view.version == 1 and view.current.full and w.full_owner == full.id
    (path,) = eng.full_loads
    assert path is not None and Path(path).name == "model" and (Path(path) / "tokenizer.json").exists()
    assert json.loads((Path(path) / "config.json").read_text()) == {"v": "base"}  # the base's config
    assert load_job(r, full.id).error == "" and _refused_metric(http, full.id) == "0.0"
    assert http.get("/readyz").status_code == 200
    # Another job arrives while the engine holds the full job's weights: refused, not served.
    other = add_job(r, base_dir, name="other", eval_size=0, group_size=2)
    feed(r, other.id, 1)
    w.tick()
    assert other.id not in w.jobs and r.xlen(keys.rollouts(other.id)) == 0
    reason = http.get("/readyz").json()["checks"][f"policy:{other.id}"]["reason"]
    assert f"full weights of job {full.id}" in reason and "full weights" in load_job(r, other.id).error
    assert _refused_metric(http, other.id) == "1.0"
    # v2 (full) replaces v1; the previous version's folder goes.
    v1_folder = view.current.folder
    publish(store, r, full.id, 2, *fake_full([-3.0, -3.0, -3.0]))
    w.refresh_jobs()
    assert view.version == 2 and len(eng.full_loads) == 2 and v1_folder and not v1_folder.exists()
    # The full job ends: the engine serves the base model again, the other job is served.
    r.srem(keys.active_jobs(), full.id)
    w.tick()
    assert eng.full_loads[-1] is None and w.full_owner is None and eng.base_lp == BASE_LP
    assert other.id in w.jobs and load_job(r, other.id).error == "" and _refused_metric(http, other.id) == "0.0"
    w.tick()
    assert r.xlen(keys.rollouts(other.id)) == 1


def test_full_weight_refusals_keep_the_previous_weights(env, base_dir: str) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make(model=base_dir)
    job = add_job(r, base_dir, eval_size=0, group_size=2)
    publish(store, r, job.id, 1, *fake_full([-2.0, -2.0, -2.0]))
    w.refresh_jobs()
    assert w.jobs[job.id].version == 1 and eng.base_lp == [-2.0] * 3
    v1_model = eng.full_loads[-1]
    # v2: a corrupted weights file -> refused by its sha256, before the engine is touched.
    publish(store, r, job.id, 2, *fake_full([-3.0, -3.0, -3.0]))
    corrupt(store, job.id, 2, "model.safetensors")
    # v3: the probe belongs to other weights -> loaded, probed, and switched back to v1.
    publish(store, r, job.id, 3, *fake_full([-4.0, -4.0, -4.0], probe_lp=[-1.0, -1.0, -1.0]))
    for _ in range(2):
        w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 1 and sorted(view.refused) == [2, 3]
    # Newest first: v3 was switched to and back (two loads), v2 never reached the engine.
    assert len(eng.full_loads) == 3 and eng.full_loads[-1] == v1_model and eng.base_lp == [-2.0] * 3
    assert "ProbeMismatch" in view.refused[3].reason and "VerificationError" in view.refused[2].reason
    reason = http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    assert "v2 refused (hash)" in reason and "still serving v1" in reason
    text = http.get("/metrics").text
    assert f'burstrl_rollout_verify_failures_total{{job="{job.id}",kind="hash"}} 1.0' in text
    assert view.current.folder and (view.current.folder / "model").is_dir()


def test_engine_without_full_weights_refuses_them(env, base_dir: str) -> None:  # noqa: ANN001
    make, store, r = env
    w, eng, http = make(model=base_dir, engine=FakeEngine(full_weights=False))
    job = add_job(r, base_dir, eval_size=0, group_size=2)
    publish(store, r, job.id, 1, *fake_full([-2.0, -2.0, -2.0]))
    w.refresh_jobs()
    view = w.jobs[job.id]
    assert view.version == 0 and 1 in view.refused and eng.full_loads == []
    reason = http.get("/readyz").json()["checks"][f"policy:{job.id}"]["reason"]
    assert "v1 refused (unsupported)" in reason and "in-process rollout pool" in reason
    assert "refused (unsupported)" in load_job(r, job.id).error
    assert not (w.cache / job.id / "policy-v1").exists()  # refused before downloading the weights
    feed(r, job.id, 1)
    w.tick()  # and the service keeps serving the job's last good version (the base)
    (_, f), *_ = r.xrange(keys.rollouts(job.id))
    assert decode(f[FIELD], GroupMsg).policy_version == 0


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
