"""The rollout worker on a fake engine, for the fast worker tests (tests/integration/
test_rollout_worker.py, test_rollout_full_weights.py): an engine whose adapters and full-weight
folders carry their probe log-probs in their weights file, versions of it to publish, a store
that counts its reads, and a worker factory over the real Redis and store."""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from services.rollout.engine import Adapter, Generation, Sample, SamplingConfig
from services.rollout.errors import AdapterError, EngineUnavailable, MissingLogprob
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from shared import keys
from shared.bus import FIELD
from shared.schema import PromptMsg, encode
from shared.service import ServiceRuntime
from shared.store import FileStore

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


def worker_factory(
    tmp_path: Path, redis_url: str, store: FileStore
) -> Callable[..., tuple[RolloutWorker, FakeEngine, TestClient]]:
    """`make(replica, engine, model)`: a rollout worker on a fake engine (a new FakeEngine unless
    given), the real Redis and `store`, with its HTTP app; evaluation and scoring in threads."""

    def make(
        replica: str = "r1", engine: FakeEngine | None = None, model: str = "tiny"
    ) -> tuple[RolloutWorker, FakeEngine, TestClient]:
        s = RolloutSettings(
            model=model,
            redis_url=redis_url,
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

    return make


def feed(r, job_id: str, n: int, prompt: str = "1+2=") -> None:  # noqa: ANN001
    for i in range(n):
        msg = PromptMsg(job_id=job_id, group_id=f"{job_id}:g{i}", item_id=str(i), prompt=prompt)
        r.xadd(keys.prompts(job_id), {FIELD: encode(msg)})
    r.hincrby(keys.ledger(job_id), "fed", n)
