"""forward_backward's protobuf body in, and the protobuf results out (services/api/tinker/tinker_wire.proto).

`read_forward_backward` turns the SDK's ForwardBackwardRequest into a TinkerCall, checking
every datum as it goes: what it cannot take raises BadInput naming the field the way a 422
does (`data[3].loss_fn_inputs.weights`), so a bad call is refused at the door and never
reaches the trainer's queue. `forward_backward_output` and `sample_response` write the
results in the form the SDK decodes (tinker/proto/response_conv.py in its wheel).
"""

from __future__ import annotations

import math

import numpy as np
from google.protobuf.message import DecodeError

from services.api.tinker import tinker_wire_pb2 as pb
from services.api.tinker.protocol import DATUMS_MAX, LOSS_CONFIG_KEYS, LOSS_INPUTS, SEQ_MAX, SUPPORTED_LOSSES
from shared.schema import SampleResult, TinkerCall, TinkerDatum, TinkerResult, TinkerTensor

_DTYPES = {pb.DTYPE_FLOAT32: ("float32", "<f4"), pb.DTYPE_INT64: ("int64", "<i8")}
# The dtype each loss input must have: target token ids, everything else float values.
_INPUT_DTYPE = {"target_tokens": "int64"}


class BadInput(ValueError):
    """A request the api refuses: `loc` is the field (as a 422's loc), `msg` what to fix."""

    def __init__(self, loc: list[str | int], msg: str) -> None:
        super().__init__(msg)
        self.loc, self.msg = loc, msg

    def detail(self) -> list[dict[str, object]]:
        return [{"type": "value_error", "loc": ["body", *self.loc], "msg": self.msg}]


def _config(req: pb.ForwardBackwardRequest, loss: str) -> dict[str, float]:
    out: dict[str, float] = dict(req.loss_fn_config)
    for k, v in req.loss_fn_config_v2.items():  # the SDK writes both; v2 wins
        if v.WhichOneof("value") != "number":
            raise BadInput(["loss_fn_config", k], f"{loss} takes numbers only")
        out[k] = v.number
    allowed = LOSS_CONFIG_KEYS[loss]
    for k, v in out.items():
        if k not in allowed:
            raise BadInput(["loss_fn_config", k], f"{loss} takes {', '.join(allowed) or 'no loss_fn_config'}")
        if not math.isfinite(v):
            raise BadInput(["loss_fn_config", k], "must be a finite number")
    return out


def _tokens(datum: pb.Datum, i: int, context: int) -> np.ndarray:
    parts = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadInput(
                ["data", i, "model_input", j], f"{kind or 'empty'} chunks are not supported: burstrl trains on text"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise BadInput(["data", i, "model_input", j, "tokens"], "int32 token ids: a multiple of 4 bytes")
        parts.append(np.frombuffer(raw, dtype="<i4"))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype="<i4")
    if not len(tokens):
        raise BadInput(["data", i, "model_input"], "no tokens")
    if int(tokens.min()) < 0:
        raise BadInput(["data", i, "model_input"], "token ids are never negative")
    if context and len(tokens) > context:
        raise BadInput(
            ["data", i, "model_input"], f"{len(tokens)} tokens, longer than the model's context of {context}"
        )
    return tokens


def _tensor(t: pb.Tensor, loc: list[str | int], want_dtype: str, n: int) -> TinkerTensor:
    if t.WhichOneof("encoding") != "dense":
        raise BadInput(loc, "sparse tensors are not supported: send it dense")
    if t.dtype not in _DTYPES:
        raise BadInput(loc, "dtype must be float32 or int64")
    dtype, np_dtype = _DTYPES[t.dtype]
    if dtype != want_dtype:
        raise BadInput(loc, f"must be {want_dtype}, got {dtype}")
    shape = list(t.shape) or [len(t.dense) // np.dtype(np_dtype).itemsize]
    if shape != [n]:
        raise BadInput(loc, f"shape {shape} disagrees with the datum's {n} tokens: it must be [{n}]")
    if len(t.dense) != n * np.dtype(np_dtype).itemsize:
        raise BadInput(loc, f"{len(t.dense)} bytes of data for shape [{n}] of {dtype}")
    values = np.frombuffer(t.dense, dtype=np_dtype)
    if dtype == "float32" and not np.isfinite(values).all():
        raise BadInput(loc, "must hold finite values only")
    if dtype == "int64" and n and int(values.min()) < 0:
        raise BadInput(loc, "token ids are never negative")
    return TinkerTensor(dtype=dtype, shape=shape, data=t.dense)


def read_forward_backward(body: bytes, *, context: int) -> tuple[str, int, bool, TinkerCall]:
    """(model id, seq_id, forward_only, the call without its job id) of a forward_backward body."""
    req = pb.ForwardBackwardRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as e:
        raise BadInput([], f"not a ForwardBackwardRequest protobuf: {e}") from None
    loss = req.loss_fn
    if loss not in SUPPORTED_LOSSES:
        raise BadInput(["loss_fn"], f"unknown loss {loss!r}: burstrl serves {', '.join(SUPPORTED_LOSSES)}")
    if not 0 <= req.seq_id <= SEQ_MAX:
        raise BadInput(["seq_id"], "must be a non-negative int32")
    if not req.data:
        raise BadInput(["data"], "no datums")
    if len(req.data) > DATUMS_MAX:
        raise BadInput(["data"], f"{len(req.data)} datums; at most {DATUMS_MAX} per request")
    config = _config(req, loss)
    wanted = LOSS_INPUTS[loss]
    data = []
    for i, datum in enumerate(req.data):
        tokens = _tokens(datum, i, context)
        given = set(datum.loss_fn_inputs)
        if missing := [k for k in wanted if k not in given]:
            raise BadInput(["data", i, "loss_fn_inputs", missing[0]], f"{loss} needs {', '.join(wanted)}")
        if extra := sorted(given - set(wanted)):
            raise BadInput(["data", i, "loss_fn_inputs", extra[0]], f"{loss} takes only {', '.join(wanted)}")
        inputs = {
            k: _tensor(
                datum.loss_fn_inputs[k], ["data", i, "loss_fn_inputs", k], _INPUT_DTYPE.get(k, "float32"), len(tokens)
            )
            for k in wanted
        }
        data.append(TinkerDatum(tokens=tokens.astype("<i4").tobytes(), inputs=inputs))
    kind = "forward" if req.forward_only else "forward_backward"
    call = TinkerCall(job_id="", seq=req.seq_id, kind=kind, request_id="", loss_fn=loss, loss_config=config, data=data)
    return req.model_id, req.seq_id, req.forward_only, call


def _batched(values: list[bytes]) -> pb.BatchedTensor:
    offsets = np.cumsum([0, *(len(v) for v in values)], dtype="<i8")
    return pb.BatchedTensor(data=b"".join(values), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def forward_backward_output(res: TinkerResult) -> bytes:
    """The SDK's ForwardBackwardOutput: one ArrayRecord with each output field batched over the datums."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=res.metrics)
    if res.outputs:
        rec = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(res.outputs))
        for name in res.outputs[0]:
            rec.fields[name].CopyFrom(_batched([o[name] for o in res.outputs]))
    return out.SerializeToString()


def sample_response(res: SampleResult) -> bytes:
    out = pb.SampleResponse()
    for tokens, logprobs, stop in zip(res.tokens, res.logprobs, res.stop_reasons, strict=True):
        reason = pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP
        out.sequences.add(stop_reason=reason, tokens=tokens, logprobs=logprobs)
    if res.prompt_logprobs:
        out.prompt_logprobs = res.prompt_logprobs
    return out.SerializeToString()
