"""Tinker calls and their futures: queue a training or sample call, answer retrieve_future.

Training calls go to the model's queue (shared/tinker_queue.py) for the trainer's Tinker
worker; sample calls to the model's sample stream for rollout. `retrieve` is the SDK's long
poll: it waits for the result's wake-up token up to POLL_S, then answers HTTP 408
`{"type": "try_again", "queue_state": ..., "queue_state_reason": ...}`, saying why it waits
(no trainer holds the model, or it is working through the queue), and the SDK polls again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
import redis.asyncio

from services.api.tinker import wire
from services.api.tinker.protocol import model_of_job, sampler_path, state_path
from shared import keys, tinker_queue
from shared.job import JobRecord
from shared.policy import read_pointer
from shared.schema import SampleCall, TinkerCall, encode

POLL_S = 10.0  # one long poll; the SDK's own timeout for it is 45 s
PROTOBUF = "application/x-protobuf"


class UnknownRequest(KeyError):
    """A request id this server never issued, or whose result was pruned (404)."""


@dataclass(frozen=True)
class Answer:
    """What retrieve_future answers: a status, and JSON or protobuf bytes."""

    status: int
    json: dict[str, object] | None = None
    proto: bytes | None = None


def digest(call: TinkerCall) -> str:
    """What makes two calls under one seq_id the same request: everything but when it came."""
    return hashlib.sha256(encode(msgspec.structs.replace(call, at=0.0, request_id=""))).hexdigest()[:32]


def submit(r: redis.Redis, rec: JobRecord, call: TinkerCall) -> dict[str, object]:
    """Queue a training call of `rec`'s model; the SDK's UntypedAPIFuture. A repeat of a call
    already queued (the SDK retried) gets the same request id. SeqRefused when it cannot be taken."""
    call.job_id = rec.id
    call.request_id = tinker_queue.request_id(rec.id, call.seq)
    call.at = time.time()
    tinker_queue.enqueue_call(r, call, digest(call))
    return {"request_id": call.request_id, "model_id": model_of_job(rec.id)}


def submit_sample(r: redis.Redis, rec: JobRecord, call: SampleCall) -> dict[str, object]:
    n = tinker_queue.next_sample_number(r, rec.id)
    call.job_id = rec.id
    call.request_id = tinker_queue.sample_request_id(rec.id, n)
    call.at = time.time()
    tinker_queue.enqueue_sample(r, call)
    return {
        "request_id": call.request_id,
        "sample_sequence_ids": [f"{call.request_id}.{i}" for i in range(call.num_samples)],
    }


def _immediate(r: redis.Redis, job: str, what: str) -> Answer | None:
    """The answer if the result is there now, else None."""
    if what.startswith("s"):
        res = tinker_queue.read_sample_result(r, job, f"{job}.{what}")
        if res is None:
            return None
        if res.error:
            return Answer(200, {"error": res.error, "category": res.category or "server"})
        return Answer(200, proto=wire.sample_response(res))
    seq = int(what)
    result = tinker_queue.read_result(r, job, seq)
    if result is None:
        return None
    if result.error:
        return Answer(200, {"error": result.error, "category": result.category or "server"})
    if result.body.get("kind") in ("forward", "forward_backward"):
        return Answer(200, proto=wire.forward_backward_output(result))
    return Answer(200, render(job, result.body, result.metrics))


def sampler_id(job: str, version: int) -> str:
    """A sampling session: a policy version of a model's job (job ids hold no '.')."""
    return f"{job}.v{version}"


def render(job: str, body: dict[str, Any], metrics: dict[str, float]) -> dict[str, object]:
    """The SDK's response type of a finished call, from what the trainer recorded of it."""
    kind, model = body.get("kind"), model_of_job(job)
    if kind == "optim_step":
        return {"metrics": metrics}
    if kind == "save_state":
        return {"type": "save_weights", "path": state_path(model, body["name"])}
    if kind == "save_for_sampler":
        if body.get("name"):
            return {"type": "save_weights_for_sampler", "path": sampler_path(model, body["name"])}
        return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id(job, body["version"])}
    if kind == "load_state":
        path = state_path(model_of_job(body["source_job"]), body["name"])
        return {"type": "load_weights", "path": path, "model_id": model}
    raise ValueError(f"a result of unknown kind {kind!r}")


def _known(r: redis.Redis, job: str, what: str) -> bool:
    if what.startswith("s"):
        return int(what[1:]) <= int(r.hget(keys.tinker_state(job), "samples") or 0)
    return r.hexists(keys.tinker_seqs(job), what)


def _waiting(r: redis.Redis, job: str, request: str, what: str) -> Answer:
    """The try_again answer, with why the request still waits."""
    if what.startswith("s"):
        state, reason = "active", f"queued for a rollout replica serving policy v{read_pointer(r, job)}"
    elif r.exists(keys.trainer_lease(job)):
        st = tinker_queue.queue_state(r, job)
        state, reason = (
            "active",
            f"a trainer holds the model; it has applied calls up to seq_id {st.get('applied', -1)}",
        )
    else:
        state = "paused_capacity"
        reason = (
            "no trainer holds this model: the call is queued and runs when a trainer starts "
            "(python -m services.trainer.tinker)"
        )
    return Answer(408, {"type": "try_again", "request_id": request, "queue_state": state, "queue_state_reason": reason})


async def retrieve(r: redis.Redis, ar: redis.asyncio.Redis, request: str) -> Answer:
    """The result of `request`, waiting up to POLL_S for it."""
    try:
        job, what = tinker_queue.parse_request_id(request)
    except ValueError as e:
        raise UnknownRequest(str(e)) from None
    # The sync Redis reads run in a worker thread: the event loop keeps serving other polls.
    if (got := await asyncio.to_thread(_immediate, r, job, what)) is not None:
        return got
    if not await asyncio.to_thread(_known, r, job, what):
        raise UnknownRequest(f"no request {request!r}: never issued here, or its result was pruned")
    await tinker_queue.wait_done(ar, job, request, POLL_S)
    if (got := await asyncio.to_thread(_immediate, r, job, what)) is not None:
        return got
    return await asyncio.to_thread(_waiting, r, job, request, what)
