"""Rollout's error taxonomy, unit by unit (fast): manifests parsed into typed errors, both
engines refusing a missing log-prob, a remote engine's HTTP answers mapped to what they
mean, and one failed request isolated from its neighbours.

The remote engine's answers come from an httpx transport that plays the server here: the
real vLLM server never leaves a sampled token's log-prob out on purpose, so these cases
cannot be provoked from it (tests/integration/test_rollout_engines.py runs the real one)."""

from __future__ import annotations

import json

import httpx
import pytest

from services.rollout.engine import SamplingConfig, checked_logprobs
from services.rollout.engine_remote import RemoteEngine
from services.rollout.errors import (
    DeposedWrite,
    EngineRequestRefused,
    EngineUnavailable,
    ManifestError,
    MissingLogprob,
    ProbeMismatch,
    RequestFailed,
    VerificationError,
    refusal_kind,
)
from services.rollout.generation import isolate
from shared.policy import parse_manifest

CFG = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_tokens=4)
GOOD = {"job_id": "j", "version": 1, "step": 1, "base_model": "m", "files": {"a.safetensors": "ab"}}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"files": {"../../etc/x": "ab"}}, "bad file entry"),
        ({"files": ["a"]}, "files is list"),
        ({"version": "1"}, "version is str"),
        ({"probe": {"token_ids": [1, 2], "logprobs": ["x"]}}, "probe"),
        ({"probe": {"token_ids": [1, 2, 3], "logprobs": [-1.0]}}, "probe"),
        ({"extra": 1}, "unknown fields extra"),
    ],
)
def test_manifests_are_checked_field_by_field(change: dict, says: str) -> None:
    assert parse_manifest(json.dumps(GOOD).encode()).files == GOOD["files"]
    with pytest.raises(ManifestError, match=says):
        parse_manifest(json.dumps({**GOOD, **change}).encode())
    for raw in (b"{", b"[]", json.dumps({k: v for k, v in GOOD.items() if k != "step"}).encode()):
        with pytest.raises(ManifestError):
            parse_manifest(raw)


def test_refusal_kinds() -> None:
    kinds = [
        refusal_kind(e)
        for e in (
            DeposedWrite("x"),
            ProbeMismatch("x"),
            VerificationError("x"),
            ManifestError("x"),
            EngineRequestRefused("x"),
            MissingLogprob("x"),
        )
    ]
    assert kinds == ["deposed", "probe", "hash", "manifest", "engine", "engine"]
    with pytest.raises(TypeError):
        refusal_kind(KeyError("a bug refuses nothing"))


def test_checked_logprobs_never_makes_one_up() -> None:
    assert checked_logprobs([-0.5, -1.0], 2, "sample", 3) == [-0.5, -1.0]
    for values in ([-0.5, None], [-0.5], [float("nan"), -1.0]):
        with pytest.raises(MissingLogprob) as info:
            checked_logprobs(values, 2, "sample", 3)
        assert info.value.index == 3


def _remote(handler) -> RemoteEngine:  # noqa: ANN001
    eng = RemoteEngine(url="http://engine.test", served_model="m")
    eng.http = httpx.Client(base_url=eng.url, transport=httpx.MockTransport(handler))
    return eng


def _completion(token_logprobs: list) -> dict:
    n = len(token_logprobs)
    return {
        "choices": [
            {
                "index": 0,
                "text": "x" * n,
                "finish_reason": "stop",
                "prompt_token_ids": [1, 2],
                "token_ids": list(range(10, 10 + n)),
                "logprobs": {"tokens": [f"token_id:{10 + i}" for i in range(n)], "token_logprobs": token_logprobs},
            }
        ]
    }


def test_remote_engine_refuses_a_missing_logprob_and_says_which_prompt() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        lps = [-0.25, None] if body["prompt"] == "bad" else [-0.25, -0.5]
        return httpx.Response(200, json=_completion(lps))

    eng = _remote(handler)
    try:
        (g,) = eng.generate(["good"], [None], CFG)
        assert g.samples[0].logprobs == [-0.25, -0.5]
        with pytest.raises(MissingLogprob) as info:  # before: the None became 0.0, trained on as p = 1
            eng.generate(["good", "bad", "good"], [None, None, None], CFG)
        assert info.value.index == 1 and "token 1" in str(info.value)
    finally:
        eng.close()


def test_remote_engine_http_answers() -> None:
    status = {"code": 400}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions" and status["code"] != 200:
            return httpx.Response(status["code"], text="nope")
        return httpx.Response(200, json={"choices": [{"index": 0, "prompt_logprobs": [None, {"7": {"logprob": -1}}]}]})

    eng = _remote(handler)
    try:
        with pytest.raises(EngineRequestRefused) as info:  # before: a ValueError, refused as "manifest"
            eng.generate(["a", "b"], [None, None], CFG)
        assert info.value.index == 0 and "HTTP 400" in str(info.value)
        status["code"] = 401  # every request would fail: the service's config, not the request's
        with pytest.raises(EngineUnavailable, match="API_KEY"):
            eng.generate(["a"], [None], CFG)
        status["code"] = 200
        assert eng.prompt_logprobs([5, 7], None) == [-1.0]
        with pytest.raises(MissingLogprob):  # the server left a position out
            eng.prompt_logprobs([5, 7, 8], None)
    finally:
        eng.close()


def test_isolate_keeps_the_neighbours_of_a_failed_request() -> None:
    calls: list[list[str]] = []

    def call(items: list[str], *, say_which: bool) -> list[str]:
        calls.append(items)
        if "bad" in items:
            raise MissingLogprob("no log-prob", items.index("bad") if say_which else None)
        return [x.upper() for x in items]

    items = ["a", "bad", "c", "d"]
    got = isolate(items, lambda xs: call(xs, say_which=True))
    assert [x if isinstance(x, str) else "ERR" for x in got] == ["A", "ERR", "C", "D"] and len(calls) == 2
    got = isolate(items, lambda xs: call(xs, say_which=False))
    assert [x if isinstance(x, str) else "ERR" for x in got] == ["A", "ERR", "C", "D"]
    assert all(isinstance(x, RequestFailed) for x in got if not isinstance(x, str))
