"""Tinker sessions and models over Redis: plain, keyword-only domain functions (docs/tinker.md).

A Tinker model is a burstrl job (`JobSpec.tinker`): its policy versions, checkpoints, lease
and pointer are a job's, so rollout adopts what its sampler saves through the verified path
(sha256 and probe) and the trainer's Tinker worker holds it under the job's lease. Its
training calls queue in shared/tinker_queue.py. Errors are domain exceptions, mapped to HTTP
codes by services/api/tinker/routes.py.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import redis
from redis.client import Pipeline

from services.api.tinker.protocol import CreateModelRequest, job_of_model, model_id
from shared import keys, tinker_queue
from shared.bus import Bus
from shared.job import JobRecord, JobSpec, JobState, JobTaken, insert_job, load_job, same_model, set_state
from shared.ledger import init_ledger
from shared.policy import init_pointer
from shared.schema import decode_heartbeat
from shared.service import active_job_ids

# LoRA alpha is not part of Tinker's LoraConfig: burstrl's default, capped where JobSpec caps it.
LORA_ALPHA = 32
# The held-out task whose first prompt (plus a fixed completion) is each version's log-prob
# probe (services/trainer/probe.py): any text does; the built-in arithmetic task is always there.
PROBE_TASK = "arith"


class NotFound(KeyError):
    """No such session or model (404)."""


class Refused(ValueError):
    """A request that names something this server will not do (400), with the field it names."""

    def __init__(self, field: str, msg: str) -> None:
        super().__init__(msg)
        self.field, self.msg = field, msg


# -- sessions ----------------------------------------------------------------------------
def create_session(r: redis.Redis, *, sdk_version: str) -> str:
    sid = secrets.token_hex(5)
    now = time.time()
    r.hset(keys.tinker_sessions(), sid, json.dumps({"created_at": now, "heartbeat_at": now, "sdk": sdk_version}))
    return sid


def heartbeat(r: redis.Redis, *, session_id: str) -> None:
    raw = r.hget(keys.tinker_sessions(), session_id)
    if raw is None:
        raise NotFound(f"no session {session_id!r}")
    rec = json.loads(raw)
    rec["heartbeat_at"] = time.time()
    r.hset(keys.tinker_sessions(), session_id, json.dumps(rec))


def finish_session(r: redis.Redis, *, session_id: str) -> list[str]:
    """The SDK closed its ServiceClient: its models' jobs complete (the worker checkpoints and lets
    them go, rollout stops serving them); their saved states stay loadable. Returns their job ids."""
    prefix = f"tinker-{session_id}-"
    done = []
    for job_id in active_job_ids(r):
        if job_id.startswith(prefix) and set_state(r, job_id, JobState.completed, only_from={JobState.running}):
            done.append(job_id)
    r.hdel(keys.tinker_sessions(), session_id)
    return done


def check_session(r: redis.Redis, session_id: str) -> None:
    if not r.hexists(keys.tinker_sessions(), session_id):
        raise NotFound(f"no session {session_id!r}: create one first (POST /api/v1/create_session)")


# -- what rollout serves -------------------------------------------------------------------
def served_models(r: redis.Redis) -> dict[str, int]:
    """Base models the rollout replicas serve now, with their context length (0: unknown)."""
    out: dict[str, int] = {}
    for key in r.scan_iter(match=keys.service_pattern(), count=200):
        if not key.decode().split(":")[-2] == "rollout":
            continue
        raw = r.get(key)
        if raw is None:
            continue
        try:
            beat = decode_heartbeat(raw)
        except ValueError:
            continue
        if beat.rollout_model:
            out[beat.rollout_model] = max(out.get(beat.rollout_model, 0), beat.max_model_len)
    return out


def model_context(r: redis.Redis, base_model: str) -> int:
    """The context length a model's calls must fit: the rollout replicas' (which serve it), else
    the model's own config.json when the api can read it, else 0 (unknown: not checked here;
    the trainer still refuses what its model cannot take)."""
    for name, ctx in served_models(r).items():
        if same_model(name, base_model) and ctx:
            return ctx
    cfg = Path(base_model) / "config.json"
    try:
        return int(json.loads(cfg.read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError):
        return 0


# -- models ------------------------------------------------------------------------------
def _spec(base_model: str, rank: int, seed: int) -> JobSpec:
    return JobSpec(
        name="tinker",
        base_model=base_model,
        lora_rank=rank,
        lora_alpha=min(LORA_ALPHA, 16 * rank),
        seed=seed,
        task=PROBE_TASK,
        eval_size=0,
        tinker=True,
    )


def create_model(r: redis.Redis, *, req: CreateModelRequest, first_seq: int = 1) -> JobRecord:
    """A new Tinker model: its job (running, served by rollout, left to the Tinker worker) and its
    call queue. `first_seq`: 1 after create_model (its seq 0), 0 when its first call is a load."""
    check_session(r, req.session_id)
    lora = req.lora_config
    if lora is None:
        raise Refused("lora_config", "burstrl trains LoRA adapters only: pass a lora_config (rank)")
    if not (lora.train_mlp and lora.train_attn):
        raise Refused("lora_config", "burstrl puts LoRA on every linear layer: train_mlp and train_attn must be true")
    if req.optimizer_config.type != "adamw":
        raise Refused("optimizer_config.type", f"only adamw is served, not {req.optimizer_config.type!r}")
    served = served_models(r)
    if served and not any(same_model(m, req.base_model) for m in served):
        raise Refused(
            "base_model", f"no rollout replica serves {req.base_model!r}; served: {', '.join(sorted(served))}"
        )
    job_id = job_of_model(model_id(req.session_id, req.model_seq_id))
    assert job_id is not None
    try:
        spec = _spec(req.base_model, lora.rank, lora.seed if lora.seed is not None else secrets.randbelow(2**31))
    except ValueError as e:
        raise Refused("base_model", str(e)) from None
    now = time.time()
    rec = JobRecord(id=job_id, spec=spec, state=JobState.running, created_at=now, updated_at=now)
    if load_job(r, job_id) is not None:  # the SDK retried a create that went through
        return load_job(r, job_id)  # type: ignore[return-value]
    Bus.ensure_groups(r, job_id)
    tinker_queue.ensure_sample_group(r, job_id)

    def keys_beside(pipe: Pipeline) -> None:
        init_pointer(pipe, job_id)  # version 0 = the base model, no adapter
        init_ledger(pipe, job_id)
        tinker_queue.init_model(pipe, job_id, first_seq=first_seq)

    try:
        insert_job(r, rec, also=keys_beside, active=True)
    except JobTaken:  # a retried create that raced the first: never over it
        return load_job(r, job_id)  # type: ignore[return-value]
    return rec


def get_model(r: redis.Redis, model: str) -> JobRecord:
    job_id = job_of_model(model)
    rec = load_job(r, job_id) if job_id else None
    if rec is None or not rec.spec.tinker:
        raise NotFound(f"no Tinker model {model!r}")
    return rec


def info(rec: JobRecord, model: str) -> dict[str, object]:
    """The SDK's GetInfoResponse."""
    name = rec.spec.base_model
    return {
        "type": "get_info",
        "model_id": model,
        "model_data": {"arch": "", "model_name": name, "tokenizer_id": name},
        "is_lora": True,
        "lora_rank": rec.spec.lora_rank,
        "model_name": name,
        "optimizer_config": {"type": "adamw"},
    }
