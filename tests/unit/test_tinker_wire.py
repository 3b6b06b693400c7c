"""The Tinker API's protobuf and losses against the SDK's own code (docs/tinker.md): what the
SDK encodes, services/api/tinker/wire.py reads; what it writes, the SDK decodes; the losses are
Tinker's documented formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.api.tinker.wire import BadInput, forward_backward_output, read_forward_backward, sample_response
from services.trainer.tinker.losses import LossInputError, elementwise_loss
from shared.schema import SampleResult, TinkerResult

tinker = pytest.importorskip("tinker")
types = tinker.types


def _sdk_body(loss: str, datums: list, config: dict | None = None) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn=loss, loss_fn_config=config),
        model_id="abcdef0123:train:0",
        seq_id=3,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def test_what_the_sdk_encodes_is_read_whole() -> None:
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [-1.0, -2.0, -3.0], "advantages": [0.5, 0.5, -1.0]},
    )
    model, seq, forward_only, call = read_forward_backward(
        _sdk_body("ppo", [d], {"clip_low_threshold": 0.7}), context=256
    )
    assert (model, seq, forward_only, call.kind, call.loss_fn) == (
        "abcdef0123:train:0",
        3,
        False,
        "forward_backward",
        "ppo",
    )
    assert call.loss_config == {"clip_low_threshold": pytest.approx(0.7)}
    (datum,) = call.data
    assert np.frombuffer(datum.tokens, "<i4").tolist() == [5, 6, 7]
    assert np.frombuffer(datum.inputs["target_tokens"].data, "<i8").tolist() == [6, 7, 8]
    assert np.frombuffer(datum.inputs["advantages"].data, "<f4").tolist() == [0.5, 0.5, -1.0]


@pytest.mark.parametrize(
    ("loss", "inputs", "config", "loc"),
    [
        ("cross_entropy", {"target_tokens": [1, 2], "weights": [1.0]}, None, ["data", 0, "loss_fn_inputs", "weights"]),
        ("cross_entropy", {"target_tokens": [1, 2]}, None, ["data", 0, "loss_fn_inputs", "weights"]),
        (
            "ppo",
            {"target_tokens": [1, 2], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0]},
            {"beta": 1.0},
            ["loss_fn_config", "beta"],
        ),
        (
            "importance_sampling",
            {"target_tokens": [1, 2], "logprobs": [0.0, float("nan")], "advantages": [1.0, 1.0]},
            None,
            ["data", 0, "loss_fn_inputs", "logprobs"],
        ),
    ],
)
def test_bad_datums_are_named(loss: str, inputs: dict, config: dict | None, loc: list) -> None:
    d = types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs=inputs)
    with pytest.raises(BadInput) as e:
        read_forward_backward(_sdk_body(loss, [d], config), context=256)
    assert e.value.loc == loc, e.value.msg


def test_a_prompt_past_the_context_and_unknown_losses_are_refused() -> None:
    d = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10))),
        loss_fn_inputs={"target_tokens": list(range(10)), "weights": [1.0] * 10},
    )
    with pytest.raises(BadInput) as e:
        read_forward_backward(_sdk_body("cross_entropy", [d]), context=8)
    assert e.value.loc == ["data", 0, "model_input"]
    body = _sdk_body("cross_entropy", [d]).replace(b"cross_entropy", b"crossxentropy")
    with pytest.raises(BadInput) as e:
        read_forward_backward(body, context=0)
    assert e.value.loc == ["loss_fn"]


def test_what_burstrl_writes_the_sdk_decodes() -> None:
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    lp = [np.array([-1.5, -0.25], "<f4"), np.array([-3.0], "<f4")]
    res = TinkerResult(
        job_id="j",
        seq=1,
        outputs=[{"logprobs": x.tobytes(), "elementwise_loss": (-x).tobytes()} for x in lp],
        metrics={"loss:sum": 4.75},
    )
    out = deserialize_forward_backward_output(forward_backward_output(res))
    assert out.metrics == {"loss:sum": 4.75}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.5, -0.25], [-3.0]]
    assert out.loss_fn_outputs[1]["elementwise_loss"].tolist() == [3.0]
    sample = SampleResult(
        job_id="j",
        request_id="j.s1",
        tokens=[np.array([4, 9], "<i4").tobytes()],
        logprobs=[np.array([-0.5, -1.0], "<f4").tobytes()],
        stop_reasons=["length"],
    )
    got = deserialize_sample_response(sample_response(sample))
    assert list(got.sequences[0].tokens) == [4, 9] and got.sequences[0].stop_reason == "length"
    assert list(got.sequences[0].logprobs) == [-0.5, -1.0]


def test_the_losses_are_tinkers_formulas() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([-1.2, -1.5, -0.5], dtype=torch.float64)
    a = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    inputs = {"logprobs": q, "advantages": a, "weights": torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)}
    r = torch.exp(logp.detach() - q)
    assert elementwise_loss("cross_entropy", logp, inputs, {}).tolist() == [1.0, 0.0, 1.0]
    torch.testing.assert_close(elementwise_loss("importance_sampling", logp, inputs, {}), -r * a)
    torch.testing.assert_close(elementwise_loss("ppo", logp, inputs, {}), -torch.minimum(r * a, r.clamp(0.8, 1.2) * a))
    torch.testing.assert_close(elementwise_loss("cispo", logp, inputs, {}), -r.clamp(0.0, 4.0) * a * logp.detach())
    torch.testing.assert_close(
        elementwise_loss("dro", logp, inputs, {"beta": 0.2}), -(logp * a - 0.1 * (logp - q) ** 2)
    )
    # cispo's weight carries no gradient: d/dlogp = -clip(r) * A
    elementwise_loss("cispo", logp, inputs, {}).sum().backward()
    torch.testing.assert_close(logp.grad, -r.clamp(0.0, 4.0) * a)
    with pytest.raises(LossInputError):
        elementwise_loss("ppo", logp, inputs, {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2})
