"""The Tinker API (docs/tinker.md) driven by the real `tinker` SDK over HTTP: the api and the
trainer's Tinker worker as processes, Redis and the store real, the tiny model.

- calls wait while no trainer holds the model (try_again, with why), and run once one starts;
- forward_backward returns burstrl's own trainer log-probs for the same tokens (cross_entropy),
  and importance_sampling, ppo, cispo and dro losses equal to their values computed here by hand;
- optim_step takes the AdamW step torch takes on the same losses (the saved state's adapter);
- save_state / create_training_client_from_state(_with_optimizer) round trip, two models at once;
- every bad input of the issue's list gets a 4xx naming it, and the session stays usable.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from shared import keys
from shared.job import JobState, load_job
from tests.support.numerics import FP32_LOGPROB_TOL, assert_same_adam_trajectory
from tests.support.stack import wait_for
from tests.support.tinker import API_KEY, TinkerStack, reference_logprobs, tinker_stack

pytestmark = pytest.mark.slow
tinker = pytest.importorskip("tinker")
types = tinker.types

RANK, SEED, LR = 8, 7, 1e-2
TOKENS = [3, 17, 42, 9, 101, 55, 23, 77, 4, 250, 31, 12, 66, 8]  # ids of the tiny model's 259-token vocab
rng = np.random.default_rng(0)
SHIFT = rng.normal(0.0, 0.3, len(TOKENS) - 1)  # the "sampler" log-probs: the policy's, moved
ADV = rng.normal(0.0, 1.0, len(TOKENS) - 1)


@pytest.fixture(scope="module")
def ts(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    with tinker_stack(tmp_path_factory.mktemp("tinker"), tiny_model) as ts:
        yield ts


def _saved_adapter(ts: TinkerStack, job: str, name: str) -> dict:
    """The adapter tensors of a saved state, read as the trainer reads it (its manifest names the
    write-once subfolder holding them; every hash checked)."""
    from safetensors.torch import load

    from services.trainer.tinker.model import named_state_prefix
    from shared.folders import get_folder
    from shared.store import FileStore

    return load(get_folder(FileStore(ts.store), named_state_prefix(job, name))[1]["adapter_model.safetensors"])


def ce_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def rl_datum(tokens: list[int], sampler_logprobs: np.ndarray, adv: np.ndarray) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": sampler_logprobs.astype(np.float32).tolist(),
            "advantages": adv.astype(np.float32).tolist(),
        },
    )


def by_hand(loss: str, lp: np.ndarray, q: np.ndarray, a: np.ndarray) -> float:
    """Tinker's documented losses, in float64 numpy."""
    r = np.exp(lp - q)
    if loss == "importance_sampling":
        return float(-(r * a).sum())
    if loss == "ppo":
        return float(-np.minimum(r * a, np.clip(r, 0.8, 1.2) * a).sum())
    if loss == "cispo":
        return float(-(np.clip(r, 0.0, 4.0) * a * lp).sum())
    if loss == "dro":
        return float(-(lp * a - 0.05 * (lp - q) ** 2).sum())
    raise ValueError(loss)


def torch_terms(loss: str, logp, q, a):  # noqa: ANN001, ANN201 - torch tensors
    """The same losses as `by_hand`, per token, in torch (differentiable in logp)."""
    import torch

    r = torch.exp(logp - q)
    if loss == "cross_entropy":
        return -logp
    if loss == "importance_sampling":
        return -r * a
    if loss == "ppo":
        return -torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    if loss == "cispo":
        return -r.clamp(0.0, 4.0).detach() * a * logp
    return -(logp * a - 0.05 * (logp - q) ** 2)


def torch_reference_step(model_path: Path, lp_sdk_losses: list[str], q: np.ndarray) -> dict:
    """The same calls in plain torch: a fresh policy (same seed), HF logits, the losses by hand,
    summed gradients, one AdamW step with the SDK's parameters. The adapter after it."""
    import torch
    from peft import get_peft_model_state_dict

    from services.trainer.policy import load_policy

    model, _ = load_policy(str(model_path), rank=RANK, alpha=32, device="cpu", seed=SEED)
    model.train()
    ids = torch.tensor([TOKENS[:-1]])
    targets = torch.tensor(TOKENS[1:])
    qt, at = torch.tensor(q, dtype=torch.float32), torch.tensor(ADV, dtype=torch.float32)
    for loss in lp_sdk_losses:
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        torch_terms(loss, logp, qt, at).sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    opt.step()
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_sdk_trains_through_burstrl(ts: TinkerStack, tiny_model: Path) -> None:
    svc = ts.client()
    tc = svc.create_lora_training_client(base_model=str(tiny_model), rank=RANK, seed=SEED).result(timeout=60)
    assert tc.get_info().lora_rank == RANK
    fut = tc.forward_backward([ce_datum(TOKENS)], "cross_entropy")

    # No trainer yet: the call waits, and retrieve_future says why (the SDK keeps polling).
    job = "tinker-" + tc.model_id.replace(":train:", "-")
    resp = httpx.post(
        f"{ts.base_url}/api/v1/retrieve_future",
        json={"request_id": f"{job}.1"},
        headers={"X-API-Key": API_KEY},
        timeout=30,
    )
    assert resp.status_code == 408, resp.text
    body = resp.json()
    assert body["type"] == "try_again" and body["queue_state"] == "paused_capacity"
    assert "no trainer holds this model" in body["queue_state_reason"]

    ts.start_worker()
    ce = fut.result(timeout=120)
    want = reference_logprobs(tiny_model, TOKENS, rank=RANK, seed=SEED)
    got = ce.loss_fn_outputs[0]["logprobs"].tolist()
    np.testing.assert_allclose(got, want, atol=FP32_LOGPROB_TOL["abs"], rtol=FP32_LOGPROB_TOL["rel"])
    assert ce.metrics["loss:sum"] == pytest.approx(-sum(want), rel=1e-5, abs=1e-3)
    np.testing.assert_allclose(ce.loss_fn_outputs[0]["elementwise_loss"].tolist(), -np.array(want), atol=1e-4)

    lp = np.array(want, dtype=np.float64)
    q = lp + SHIFT
    losses = ["importance_sampling", "ppo", "cispo", "dro"]
    futures = {loss: tc.forward_backward([rl_datum(TOKENS, q, ADV)], loss) for loss in losses}
    for loss in losses:
        out = futures[loss].result(timeout=60)
        assert out.metrics["loss:sum"] == pytest.approx(by_hand(loss, lp, q, ADV), rel=1e-4, abs=1e-3), loss
        np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].tolist(), want, atol=1e-4)

    tc.optim_step(types.AdamParams(learning_rate=LR)).result(timeout=60)
    saved = tc.save_state("after-one-step").result(timeout=60)
    assert saved.path == f"tinker://{tc.model_id}/weights/after-one-step"

    got_adapter = _saved_adapter(ts, job, "after-one-step")
    want_adapter = torch_reference_step(tiny_model, ["cross_entropy", *losses], q)
    assert_same_adam_trajectory(got_adapter, want_adapter, step=LR)

    # The state round trip: a second model from the saved state, with its optimizer, trained at the
    # same time as the first on the same datum, takes the same step (AdamW's moments came along).
    tc2 = svc.create_training_client_from_state_with_optimizer(saved.path).result(timeout=120)
    assert tc2.model_id != tc.model_id
    both = [c.forward_backward([ce_datum(TOKENS)], "cross_entropy") for c in (tc, tc2)]
    steps = [c.optim_step(types.AdamParams(learning_rate=LR)) for c in (tc, tc2)]
    first, second = (f.result(timeout=120) for f in both)
    np.testing.assert_allclose(
        second.loss_fn_outputs[0]["logprobs"].tolist(), first.loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-5
    )
    for s in steps:
        s.result(timeout=60)
    after = [c.forward([ce_datum(TOKENS)], "cross_entropy").result(timeout=60) for c in (tc, tc2)]
    np.testing.assert_allclose(
        after[1].loss_fn_outputs[0]["logprobs"].tolist(), after[0].loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-4
    )
    assert after[0].metrics["loss:sum"] < first.metrics["loss:sum"]  # the step lowered the loss it followed

    # Without the optimizer: the weights come back, AdamW starts afresh (its first step differs).
    tc3 = svc.create_training_client_from_state(saved.path).result(timeout=120)
    fresh = tc3.forward([ce_datum(TOKENS)], "cross_entropy").result(timeout=60)
    np.testing.assert_allclose(
        fresh.loss_fn_outputs[0]["logprobs"].tolist(), first.loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-5
    )


# -- bad input: a 4xx naming what is wrong, and the session still works ------------------------
def _proto_body(
    model_id: str, seq: int, *, loss: str = "cross_entropy", n: int = 4, weights: int | None = None
) -> bytes:
    """A ForwardBackwardRequest as the SDK encodes it (its own protobuf module)."""
    from tinker.proto import tinker_public_pb2 as pb

    req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn=loss)
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, n + 1, dtype=np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.arange(2, n + 2, dtype=np.int64).tobytes(), dtype=pb.DTYPE_INT64, shape=[n])
    )
    w = n if weights is None else weights
    d.loss_fn_inputs["weights"].CopyFrom(
        pb.Tensor(dense=np.ones(w, np.float32).tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[w])
    )
    return req.SerializeToString()


def test_bad_input_is_named_and_the_session_goes_on(ts: TinkerStack, tiny_model: Path) -> None:
    if "tinker" not in ts.stack.launcher.procs():
        ts.start_worker()
    svc = ts.client()
    tc = svc.create_lora_training_client(base_model=str(tiny_model), rank=RANK, seed=SEED).result(timeout=60)
    tc.forward([ce_datum(TOKENS)], "cross_entropy").result(timeout=60)  # seq 1 used
    url, key = ts.base_url + "/api/v1", {"X-API-Key": API_KEY}
    proto = {**key, "Content-Type": "application/x-protobuf"}

    def post(path: str, **kw):  # noqa: ANN003, ANN202
        return httpx.post(url + path, timeout=30, **kw)

    def names(resp: httpx.Response, *loc: object) -> None:
        assert 400 <= resp.status_code < 500, resp.text
        detail = resp.json()["detail"]
        assert any(list(d.get("loc", []))[1 : 1 + len(loc)] == list(loc) for d in detail), detail

    names(post("/forward_backward", content=_proto_body(tc.model_id, 2, loss="kl_magic"), headers=proto), "loss_fn")
    names(
        post("/forward_backward", content=_proto_body(tc.model_id, 2, weights=3), headers=proto),
        "data",
        0,
        "loss_fn_inputs",
        "weights",
    )
    # seq_id 1 is taken by another call; a seq_id far ahead could hold a slot forever
    names(post("/forward_backward", content=_proto_body(tc.model_id, 1), headers=proto), "seq_id")
    names(post("/forward_backward", content=_proto_body(tc.model_id, 10**6), headers=proto), "seq_id")
    long_prompt = _proto_body(tc.model_id, 2, n=300)  # the tiny model's context is 256
    names(post("/forward_backward", content=long_prompt, headers=proto), "data", 0, "model_input")
    big = post("/forward_backward", content=b"\0" * (2 << 20), headers=proto)
    assert big.status_code == 413 and "larger than" in big.json()["detail"]
    no_tml = post("/get_info", json={"model_id": tc.model_id}, headers={"X-API-Key": API_KEY[4:]})
    assert no_tml.status_code == 401 and "tml-" in no_tml.json()["detail"]
    wrong = post("/get_info", json={"model_id": tc.model_id}, headers={"X-API-Key": "tml-not-the-token-at-all"})
    assert wrong.status_code == 401
    # The session goes on: the SDK's next call (seq 2) is served as if nothing had happened.
    out = tc.forward_backward([ce_datum(TOKENS)], "cross_entropy").result(timeout=60)
    assert math.isfinite(out.metrics["loss:sum"])

    # Closing the client completes its model's job: the worker lets it go, rollout stops serving it.
    job = "tinker-" + tc.model_id.replace(":train:", "-")
    svc.close("success").result(timeout=60)
    r = ts.stack.redis.client()
    wait_for(lambda: load_job(r, job).state == JobState.completed, 30, "the closed session's model completed")
    wait_for(lambda: not r.exists(keys.trainer_lease(job)), 30, "the worker letting the model go", ts.stack.launcher)


# -- the trainer comes and goes mid-loop: each call applied once --------------------------------
def torch_reference_loop(model_path: Path, batches: list[list[int]]) -> dict:
    """len(batches) steps of cross_entropy + AdamW in plain torch, from a fresh policy."""
    import torch
    from peft import get_peft_model_state_dict

    from services.trainer.policy import load_policy

    model, _ = load_policy(str(model_path), rank=RANK, alpha=32, device="cpu", seed=SEED)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95), eps=1e-12)
    for toks in batches:
        logits = model(input_ids=torch.tensor([toks[:-1]])).logits[0].float()
        (-logits.log_softmax(-1).gather(-1, torch.tensor(toks[1:])[:, None])).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_trainer_killed_and_stopped_mid_loop_applies_each_call_once(ts: TinkerStack, tiny_model: Path) -> None:
    if "tinker" in ts.stack.launcher.procs():
        ts.stop_worker()
    short = {"BURSTRL_TRAINER_LEASE_S": "5"}  # a killed worker's lease frees in 5 s, not 30
    ts.start_worker(**short)
    svc = ts.client()
    tc = svc.create_lora_training_client(base_model=str(tiny_model), rank=RANK, seed=SEED).result(timeout=60)
    batches = [TOKENS[i:] + TOKENS[:i] for i in range(6)]
    steps = []
    for i, toks in enumerate(batches):
        fb = tc.forward_backward([ce_datum(toks)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=LR))
        if i == 2:  # killed while step 3's calls are queued or running: nothing more of it is written
            ts.stop_worker(kill=True)
            ts.start_worker(**short)
        if i == 4:  # stopped: it checkpoints what holds no pending gradient and hands the lease back
            fb.result(timeout=120)
            ts.stop_worker()
            ts.start_worker(**short)
        fb.result(timeout=180)
        steps.append(opt.result(timeout=180).metrics["optimizer_step:sum"])
    assert steps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # each optim_step took its own step, once
    job = "tinker-" + tc.model_id.replace(":train:", "-")
    tc.save_state("after-loop").result(timeout=60)

    got = _saved_adapter(ts, job, "after-loop")
    assert_same_adam_trajectory(got, torch_reference_loop(tiny_model, batches), step=LR)
