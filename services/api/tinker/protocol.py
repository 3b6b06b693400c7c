"""The Tinker API's JSON wire types (SDK -> api), their bounds, and the ids the api issues.

Every JSON body the tinker SDK (0.38.0) sends is one of these models: fields the SDK sends
and burstrl does not read are ignored (a newer SDK adds some), and every string, list and
number that is read is bounded here, so a 422 names the field (docs/architecture.md,
invariant 8). forward_backward's body is protobuf: services/api/tinker/wire.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from shared.limits import SEED_MAX, ModelRef, Name, Shown

# -- the ids this api issues -------------------------------------------------------------
# A session id: 10 hex digits. A model id is what the SDK derives for a model created from a
# checkpoint, f"{session_id}:train:{model_seq_id}", so every model gets that form; its job id
# (a burstrl job, docs/tinker.md) must be a job-id slug, so it is spelled with dashes.
SESSION_RE = re.compile(r"^[0-9a-f]{10}$")
MODEL_RE = re.compile(r"^([0-9a-f]{10}):train:(\d{1,6})$")
MODEL_SEQ_MAX = 999_999
# A checkpoint name (save_state, save_weights_for_sampler): one path segment of a tinker:// path.
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
SEQ_MAX = 2**31 - 1  # the proto's seq_id is an int32

SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
# What each loss reads from a datum's loss_fn_inputs, and which loss_fn_config keys it takes.
LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
LOSS_CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
}

# -- bounds ------------------------------------------------------------------------------
# Datums in one forward_backward request: the SDK cuts a call into chunks of at most
# `fwdbwd_max_chunk_len` datums (client/config says how many); more is a client that ignores it.
DATUMS_MAX = 1024
# Estimated bytes of one forward_backward chunk (the SDK's own estimate: 4 per token, the
# tensors' bytes): kept under the api's 1 MiB body limit with room for the proto's framing.
CHUNK_BYTES = 600_000
SAMPLES_MAX = 128  # num_samples of one sample call
STOP_MAX = 16  # stop strings or tokens of one sample call
MAX_TOKENS_MAX = 32_768

# Ids and paths are shown to people (dashboard, logs): bounded, no control or format characters.
CheckpointName = Annotated[str, StringConstraints(pattern=NAME_RE)]
ModelId = Annotated[str, StringConstraints(max_length=64), Shown]
SessionId = Annotated[str, StringConstraints(max_length=64), Shown]
RequestId = Annotated[str, StringConstraints(max_length=128), Shown]
Path = Annotated[str, StringConstraints(max_length=512), Shown]
Seq = Annotated[int, Field(ge=0, le=SEQ_MAX)]


def model_id(session_id: str, model_seq: int) -> str:
    return f"{session_id}:train:{model_seq}"


def job_of_model(model: str) -> str | None:
    """The burstrl job id of a Tinker model id (None: not an id this api issues)."""
    m = MODEL_RE.match(model)
    return f"tinker-{m.group(1)}-{m.group(2)}" if m else None


def model_of_job(job_id: str) -> str:
    _, session, seq = job_id.split("-")
    return model_id(session, int(seq))


def state_path(model: str, name: str) -> str:
    return f"tinker://{model}/weights/{name}"


def sampler_path(model: str, name: str) -> str:
    return f"tinker://{model}/sampler_weights/{name}"


def parse_path(path: str) -> tuple[str, str, str] | None:
    """(model id, kind "weights" | "sampler_weights", name) of a tinker:// path this api issued."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not re.match(NAME_RE, parts[2]):
        return None
    return (parts[0], parts[1], parts[2]) if MODEL_RE.match(parts[0]) else None


class Body(BaseModel):
    """An SDK body: unknown fields ignored (newer SDKs add some), numbers finite."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


# -- SDK -> api ------------------------------------------------------------------------------
class ClientConfigRequest(Body):
    sdk_version: Name = ""


class CreateSessionRequest(Body):
    sdk_version: Name = ""
    tags: Annotated[list[Name], Field(max_length=32)] = []


class SessionRef(Body):
    session_id: SessionId


class LoraConfig(Body):
    rank: int = Field(ge=1, le=256, description="LoRA rank (vLLM serves 1..256)")
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class OptimizerConfig(Body):
    model_config = ConfigDict(extra="allow")
    type: Name = "adamw"


class CreateModelRequest(Body):
    session_id: SessionId
    model_seq_id: int = Field(ge=0, le=MODEL_SEQ_MAX)
    base_model: Annotated[ModelRef, StringConstraints(min_length=1)]
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()
    user_metadata: dict[str, Any] | None = Field(None, max_length=32)


class ModelIdRequest(Body):
    model_id: ModelId


class AdamParams(Body):
    """torch.optim.AdamW's arguments, as the SDK names them (its defaults)."""

    learning_rate: float = Field(1e-4, ge=0.0, le=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    grad_clip_norm: float = Field(0.0, ge=0.0, le=1e6)


class OptimStepRequest(Body):
    model_id: ModelId
    seq_id: Seq
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = Field(None, max_length=16)


class SaveWeightsRequest(Body):
    model_id: ModelId
    seq_id: Seq
    path: CheckpointName | None = None
    ttl_seconds: int | None = Field(None, ge=0)
    overwrite: bool = False


class SaveForSamplerRequest(Body):
    model_id: ModelId
    seq_id: Seq
    path: CheckpointName | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0, le=SEQ_MAX)
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: int | None = Field(None, ge=0)


class LoadWeightsRequest(Body):
    """Two forms: a load into an existing model (model_id + seq_id), or a new model created
    from a checkpoint (session_id + model_seq_id, its first call, seq_id 0)."""

    path: Path
    optimizer: bool = False
    model_id: ModelId | None = None
    seq_id: Seq | None = None
    session_id: SessionId | None = None
    model_seq_id: int | None = Field(None, ge=0, le=MODEL_SEQ_MAX)
    base_model: ModelRef | None = None


class CreateSamplingSessionRequest(Body):
    session_id: SessionId
    sampling_session_seq_id: int = Field(ge=0, le=SEQ_MAX)
    model_path: Path | None = None
    base_model: ModelRef | None = None


class EncodedText(Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(max_length=MAX_TOKENS_MAX)]


class ModelInput(Body):
    # Only text: an image (or audio) chunk fails here with a 422 that names the chunk.
    chunks: Annotated[list[EncodedText], Field(min_length=1, max_length=64)]


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: (
        Annotated[str, StringConstraints(max_length=64)]
        | Annotated[list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=STOP_MAX)]
        | Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(max_length=STOP_MAX)]
        | None
    ) = None
    temperature: float = Field(1.0, ge=0.0, le=4.0)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class SampleRequest(Body):
    sampling_session_id: RequestId | None = None
    seq_id: Seq | None = None
    model_path: Path | None = None
    base_model: ModelRef | None = None
    num_samples: int = Field(1, ge=1, le=SAMPLES_MAX)
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(0, ge=0, le=0, description="top-k prompt log-probs are not served")
    topk_sample_logprobs: int = Field(0, ge=0, le=0, description="top-k sample log-probs are not served")


class FutureRetrieveRequest(Body):
    request_id: RequestId
    allow_metadata_only: bool = False


class CancelRequest(Body):
    request_id: RequestId
