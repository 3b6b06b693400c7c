"""Every message that crosses Redis, typed and versioned (msgspec).

Stage streams carry msgpack (PromptMsg, GroupMsg, DeadLetter); the
metrics stream and the service heartbeats carry JSON (people and dashboards read them).
Direction is in each type's docstring. Token ids and log-probs travel as packed
little-endian arrays (int32 / float32 bytes): ~4x smaller than msgpack lists and
decoded with one numpy call. Never pickle: a consumer must be able to reject bytes
it does not understand, and put them on the dead-letter stream with the reason.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np

SCHEMA_VERSION = 1


def pack_i32(xs: list[int] | np.ndarray) -> bytes:
    return np.asarray(xs, dtype="<i4").tobytes()


def pack_f32(xs: list[float] | np.ndarray) -> bytes:
    return np.asarray(xs, dtype="<f4").tobytes()


def pack_u8(xs: list[int] | np.ndarray) -> bytes:
    return np.asarray(xs, dtype="<u1").tobytes()


def unpack_i32(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<i4")


def unpack_f32(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<f4")


def unpack_u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<u1")


class Message(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base: every message carries its schema version and job."""

    v: int = SCHEMA_VERSION
    job_id: str


class PromptMsg(Message, tag="prompt", kw_only=True):
    """api -> rollout: one prompt; rollout turns it into one group of G completions."""

    group_id: str
    item_id: str
    prompt: str
    fields: dict[str, str] = {}
    fed_at: float = 0.0


class Completion(msgspec.Struct, kw_only=True):
    """One sampled completion. Token arrays are packed; all have len(token_ids) entries.

    A multi-turn episode also carries its model turns (K of them): where each starts in
    token_ids and the environment's step reward for it, so the trainer can credit turns
    separately (algorithm.advantage_level = "turn"). Single-turn completions leave both
    empty; they default to b"" so messages without them still decode, and older readers
    ignore them.
    """

    token_ids: bytes  # int32[T]
    logprobs: bytes  # float32[T]: the sampler's log-prob of each sampled token
    loss_mask: bytes  # uint8[T]: 1 = trained on (0 for tool output in multi-turn)
    text: str
    finish_reason: str  # "stop" | "length" | ...
    reward: float = 0.0
    reward_parts: dict[str, float] = {}
    ref_logprobs: bytes = b""  # float32[T], filled by ref
    turn_starts: bytes = b""  # int32[K]: index into token_ids where model turn k starts (ascending)
    turn_rewards: bytes = b""  # float32[K]: the environment's step reward for model turn k (tags excluded)


class GroupMsg(Message, tag="group", kw_only=True):
    """rollout -> reward -> (ref ->) trainer: G completions of one prompt.

    The same type flows through every stage; `stage` says how far it got, so a
    consumer can reject a group that skipped a stage it depends on.
    """

    group_id: str
    item_id: str
    prompt: str
    prompt_ids: bytes  # int32[P]
    fields: dict[str, str] = {}
    policy_version: int
    completions: list[Completion]
    stage: str = "rolled"  # "rolled" -> "scored" -> "ready"
    sampled_at: float = 0.0


class DeadLetter(msgspec.Struct, kw_only=True):
    """any stage -> dead stream: what could not be handled, and why."""

    stream: str
    entry_id: str
    reason: str
    payload: bytes
    at: float


class Heartbeat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """every service -> Redis key `svc:{role}:{replica}` (JSON, expiring): alive, ready, why not.

    JSON rather than msgpack: dashboards and people read it. Unknown fields are ignored
    on decode, so a newer service can add a gauge without breaking an older api.
    """

    v: int = SCHEMA_VERSION
    role: str
    replica: str
    host: str
    port: int
    version: str
    ready: bool
    reasons: dict[str, str] = {}
    at: float
    # Gauges some roles add: rollout and trainer the policy version they serve per job;
    # reward whether code rewards can run; ref which model and engine it scores with;
    # rollout its base model and context length (the api refuses a job whose
    # sampling.max_tokens cannot fit it; 0: not advertised).
    policy_versions: dict[str, int] = {}
    dataset: str = ""  # the Redis dataset id this replica started on (shared/dataset.py)
    sandbox: str = ""
    ref_model: str = ""
    ref_engine: str = ""
    rollout_model: str = ""
    max_model_len: int = 0
    idle_frac: float | None = None  # rollout: wall time not in the engine over its last window


# -- the Tinker API (docs/tinker.md, shared/tinker_queue.py) --------------------------------
class TinkerTensor(msgspec.Struct, kw_only=True):
    """One `loss_fn_inputs` tensor of a datum: packed little-endian values and their shape."""

    dtype: str  # "float32" | "int64"
    shape: list[int]
    data: bytes


class TinkerDatum(msgspec.Struct, kw_only=True):
    """One datum of a forward(_backward) call: the model input and the loss's inputs, shifted
    as Tinker defines them (position i of every input belongs to the token predicted there)."""

    tokens: bytes  # int32[N]
    inputs: dict[str, TinkerTensor] = {}


class TinkerCall(Message, tag="tinker_call", kw_only=True):
    """api -> trainer (Tinker worker): one training call of a Tinker model, applied in `seq` order.

    kind: forward | forward_backward | optim_step | save_state | load_state | save_for_sampler.
    """

    seq: int
    kind: str
    request_id: str
    loss_fn: str = ""
    loss_config: dict[str, float] = {}
    data: list[TinkerDatum] = []
    adam: dict[str, float] = {}
    name: str = ""  # save_state / save_for_sampler: the checkpoint's name; load_state: its job and name
    source_job: str = ""  # load_state: the model whose checkpoint is loaded
    optimizer: bool = False  # load_state: also the optimizer's state
    at: float = 0.0


class TinkerResult(Message, tag="tinker_result", kw_only=True):
    """trainer -> api: what a Tinker call returned. `error` set: it failed (category user or
    server) and changed nothing. `outputs`: per datum, name -> float32 values (logprobs,
    elementwise_loss); `body`: the JSON response of the other calls."""

    seq: int
    error: str = ""
    category: str = ""
    outputs: list[dict[str, bytes]] = []
    metrics: dict[str, float] = {}
    body: dict[str, Any] = {}


class SampleCall(Message, tag="tinker_sample", kw_only=True):
    """api -> rollout: one Tinker sample call on a policy version of a Tinker model's job."""

    request_id: str
    version: int
    prompt: bytes  # int32[P]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = []
    stop_tokens: list[int] = []
    prompt_logprobs: bool = False
    at: float = 0.0


class SampleResult(Message, tag="tinker_sample_result", kw_only=True):
    """rollout -> api: the sequences of a sample call (tokens int32, log-probs float32), or its error."""

    request_id: str
    error: str = ""
    category: str = ""
    tokens: list[bytes] = []
    logprobs: list[bytes] = []
    stop_reasons: list[str] = []  # "stop" | "length"
    prompt_logprobs: bytes = b""  # float32[P], NaN at position 0


TinkerMessage = TinkerCall | TinkerResult | SampleCall | SampleResult
_tinker_decoder = msgspec.msgpack.Decoder(TinkerMessage)
M = TypeVar("M", TinkerCall, TinkerResult, SampleCall, SampleResult)


def decode_tinker(data: bytes, expected: type[M]) -> M:
    """Decode a Tinker message and check its type and schema version."""
    return _checked(_tinker_decoder.decode(data), expected)


# Top level flat (one series per key); a value may be a small dict or list (histograms, parts).
MetricValue = float | int | str | bool | None | dict[str, Any] | list[Any]


def _plain(x: object) -> object:
    """numpy / torch scalars -> Python numbers (msgspec's hook for types it does not know)."""
    if hasattr(x, "item"):
        return x.item()  # type: ignore[union-attr]
    raise TypeError(f"metric value of type {type(x).__name__} is not a number, string, list or dict")


_json_encoder = msgspec.json.Encoder(enc_hook=_plain)
_point_decoder = msgspec.json.Decoder(dict[str, MetricValue])
_beat_decoder = msgspec.json.Decoder(Heartbeat)


def encode_point(source: str, at: float, values: dict[str, object]) -> bytes:
    """any stage -> job metrics stream: one flat JSON point {source, at, **values}.

    NaN and infinities become null: a NaN loss must show as a gap on the dashboard, not
    make every JSON reader (browsers' JSON.parse included) reject the whole series.
    """
    return _json_encoder.encode({"source": source, "at": at, **values})


def decode_point(data: bytes) -> dict[str, MetricValue]:
    """Raises msgspec.ValidationError / DecodeError on a point that is not flat metric JSON."""
    return _point_decoder.decode(data)


def encode_heartbeat(beat: Heartbeat) -> bytes:
    return _json_encoder.encode(beat)


def decode_heartbeat(data: bytes) -> Heartbeat:
    return _beat_decoder.decode(data)


AnyMessage = PromptMsg | GroupMsg
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
T = TypeVar("T", bound=Message)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, expected: type[T]) -> T:
    """Decode and check the type; raises msgspec.ValidationError / DecodeError / TypeError."""
    return _checked(_decoder.decode(data), expected)


def _checked(msg: Message, expected: type[T]) -> T:
    """`msg`, once it is an `expected` of this schema version (the one check every decode makes)."""
    if not isinstance(msg, expected):
        raise TypeError(f"expected {expected.__name__}, got {type(msg).__name__}")
    if msg.v != SCHEMA_VERSION:
        raise TypeError(f"schema version {msg.v} is not {SCHEMA_VERSION}")
    return msg


def encode_dead(d: DeadLetter) -> bytes:
    return _encoder.encode(d)


def decode_dead(data: bytes) -> DeadLetter:
    return msgspec.msgpack.decode(data, type=DeadLetter)
