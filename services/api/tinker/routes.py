"""The Tinker API's routes on the api service, under /api/v1 (docs/tinker.md): thin routers
over services/api/tinker/models.py and calls.py.

Authenticated by the SDK's `X-API-Key` header: `tml-` followed by the services' token
(BURSTRL_TOKEN), compared in constant time. Bodies are bounded by the api's body limit (413,
services/api/http_limits.py); client/config tells the SDK to cut forward_backward calls into
chunks that fit it.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
import redis
import redis.asyncio
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from services.api.tinker import calls, models, wire
from services.api.tinker.protocol import (
    CHUNK_BYTES,
    DATUMS_MAX,
    AdamParams,
    CancelRequest,
    ClientConfigRequest,
    CreateModelRequest,
    CreateSamplingSessionRequest,
    CreateSessionRequest,
    FutureRetrieveRequest,
    LoadWeightsRequest,
    ModelIdRequest,
    OptimStepRequest,
    SampleRequest,
    SaveForSamplerRequest,
    SaveWeightsRequest,
    SessionRef,
    job_of_model,
    model_id,
    model_of_job,
    parse_path,
)
from shared import keys, tinker_queue
from shared.job import JobRecord, load_job
from shared.policy import read_pointer
from shared.redis_conn import connect_async
from shared.schema import SampleCall, TinkerCall
from shared.service import ServiceRuntime
from shared.settings import CommonSettings

KEY_PREFIX = "tml-"
PREFIX = "/api/v1"  # where the Tinker API lives on the api service
CONTEXT_CACHE_S = 30.0


def key_refusal(settings: CommonSettings, x_api_key: str | None) -> HTTPException | None:
    """The 401 for a request without the key, `tml-` + the token (None: it has it). In local-dev mode
    without a token any `tml-` key is taken."""
    if not x_api_key:
        return HTTPException(401, "X-API-Key is missing: set TINKER_API_KEY=tml-<BURSTRL_TOKEN>")
    if not x_api_key.startswith(KEY_PREFIX):
        return HTTPException(401, "X-API-Key must be 'tml-' followed by the services' token (BURSTRL_TOKEN)")
    if settings.dev and not settings.token:
        return None
    if not hmac.compare_digest(x_api_key[len(KEY_PREFIX) :].encode(), settings.token.encode()):
        return HTTPException(401, "X-API-Key is wrong: 'tml-' followed by the services' token (BURSTRL_TOKEN)")
    return None


def api_key_auth(settings: CommonSettings) -> Callable[..., None]:
    """X-API-Key, checked by the service's door before the body (ServiceRuntime.guard) and again here."""

    def check(x_api_key: Annotated[str | None, Header()] = None) -> None:
        if (refused := key_refusal(settings, x_api_key)) is not None:
            raise refused

    return check


def _refused(field: str, msg: str, status: int = 400) -> HTTPException:
    loc = [int(p) if p.isdigit() else p for p in field.split(".")]
    return HTTPException(status, [{"type": "value_error", "loc": ["body", *loc], "msg": msg}])


def _model(r: redis.Redis, model: str) -> JobRecord:
    try:
        return models.get_model(r, model)
    except models.NotFound as e:
        raise HTTPException(404, str(e.args[0])) from None


def _submit(r: redis.Redis, rec: JobRecord, call: TinkerCall) -> dict[str, object]:
    try:
        return calls.submit(r, rec, call)
    except tinker_queue.SeqRefused as e:
        raise _refused("seq_id", str(e)) from None


def service_router(r: redis.Redis) -> APIRouter:
    router = APIRouter(tags=["tinker"])

    @router.post("/client/config")
    def client_config(req: ClientConfigRequest) -> dict[str, Any]:
        """Feature flags for the SDK: API keys (no JWT exchange), plain httpx, uncompressed
        protobuf, and forward_backward chunks that fit the api's body limit."""
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": DATUMS_MAX,
            "fwdbwd_max_chunk_bytes_count": CHUNK_BYTES,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    @router.post("/client/dynamic_config")
    def dynamic_config(req: ClientConfigRequest) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @router.post("/create_session")
    def create_session(req: CreateSessionRequest) -> dict[str, Any]:
        return {"type": "create_session", "session_id": models.create_session(r, sdk_version=req.sdk_version)}

    @router.post("/session_heartbeat")
    def session_heartbeat(req: SessionRef) -> dict[str, Any]:
        try:
            models.heartbeat(r, session_id=req.session_id)
        except models.NotFound as e:
            raise HTTPException(404, str(e.args[0])) from None
        return {"type": "session_heartbeat"}

    @router.post("/sessions/{session_id}/finish")
    def finish_session(session_id: str) -> dict[str, Any]:
        """ServiceClient.close(): the session's models are done (their saved states stay)."""
        return {"completed": models.finish_session(r, session_id=session_id)}

    @router.post("/telemetry")
    def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}  # the SDK's usage events: not collected here

    @router.get("/get_server_capabilities")
    def capabilities() -> dict[str, Any]:
        return {
            "supported_models": [
                {"model_name": m, "max_context_length": ctx or None, "trainable": True, "sampleable": True}
                for m, ctx in sorted(models.served_models(r).items())
            ]
        }

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return router


def _context_cache(r: redis.Redis) -> Callable[[JobRecord], int]:
    """A model's context length (models.model_context), looked up at most every CONTEXT_CACHE_S."""
    contexts: dict[str, tuple[float, int]] = {}

    def context(rec: JobRecord) -> int:
        at, ctx = contexts.get(rec.spec.base_model, (-CONTEXT_CACHE_S, 0))
        if time.monotonic() - at >= CONTEXT_CACHE_S:
            ctx = models.model_context(r, rec.spec.base_model)
            contexts[rec.spec.base_model] = (time.monotonic(), ctx)
        return ctx

    return context


def training_router(r: redis.Redis) -> APIRouter:
    router = APIRouter(tags=["tinker"])
    context = _context_cache(r)

    @router.post("/create_model")
    def create_model(req: CreateModelRequest) -> dict[str, Any]:
        try:
            rec = models.create_model(r, req=req)
        except models.NotFound as e:
            raise HTTPException(404, str(e.args[0])) from None
        except models.Refused as e:
            raise _refused(e.field, e.msg) from None
        return {"request_id": f"{rec.id}.create", "model_id": model_id(req.session_id, req.model_seq_id)}

    @router.post("/get_info")
    def get_info(req: ModelIdRequest) -> dict[str, Any]:
        return models.info(_model(r, req.model_id), req.model_id)

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        body = await request.body()  # bounded by the api's body limit before a byte is parsed
        if "protobuf" not in request.headers.get("content-type", ""):
            raise HTTPException(415, "forward_backward takes the SDK's protobuf body (application/x-protobuf)")
        if request.headers.get("content-encoding"):
            raise HTTPException(415, "compressed bodies are not taken: client/config says so")
        try:
            model, _, _, call = wire.read_forward_backward(body, context=0)
        except wire.BadInput as e:
            raise HTTPException(400, e.detail()) from None
        rec = await run_in_threadpool(_model, r, model)
        ctx = await run_in_threadpool(context, rec)
        for i, d in enumerate(call.data):
            if ctx and len(d.tokens) // 4 > ctx:
                raise _refused(
                    f"data.{i}.model_input", f"{len(d.tokens) // 4} tokens, longer than the model's context of {ctx}"
                )
        return await run_in_threadpool(_submit, r, rec, call)

    @router.post("/optim_step")
    def optim_step(req: OptimStepRequest) -> dict[str, Any]:
        rec = _model(r, req.model_id)
        if req.optimizer_params is not None and req.adam_params is None:
            raise _refused("optimizer_params", "only AdamParams are served (the model's optimizer is adamw)")
        adam = (req.adam_params or AdamParams()).model_dump()
        return _submit(r, rec, TinkerCall(job_id="", seq=req.seq_id, kind="optim_step", request_id="", adam=adam))

    @router.post("/save_weights")
    def save_weights(req: SaveWeightsRequest) -> dict[str, Any]:
        rec = _model(r, req.model_id)
        name = req.path or f"seq-{req.seq_id}"
        return _submit(r, rec, TinkerCall(job_id="", seq=req.seq_id, kind="save_state", request_id="", name=name))

    @router.post("/save_weights_for_sampler")
    def save_for_sampler(req: SaveForSamplerRequest) -> dict[str, Any]:
        rec = _model(r, req.model_id)
        call = TinkerCall(job_id="", seq=req.seq_id, kind="save_for_sampler", request_id="", name=req.path or "")
        return _submit(r, rec, call)

    @router.post("/load_weights")
    def load_weights(req: LoadWeightsRequest) -> dict[str, Any]:
        parsed = parse_path(req.path)
        if parsed is None or parsed[1] != "weights":
            raise _refused("path", "a tinker://<model_id>/weights/<name> path that save_state returned")
        source = job_of_model(parsed[0])
        if req.session_id is not None:  # a new model from the checkpoint: its first call (seq 0)
            src = _model(r, parsed[0])
            if req.model_seq_id is None:
                raise _refused("model_seq_id", "needed with session_id")
            create = CreateModelRequest(
                session_id=req.session_id,
                model_seq_id=req.model_seq_id,
                base_model=req.base_model or src.spec.base_model,
                lora_config={"rank": src.spec.lora_rank, "seed": src.spec.seed},  # type: ignore[arg-type]
            )
            try:
                rec = models.create_model(r, req=create, first_seq=0)
            except (models.NotFound, models.Refused) as e:
                raise _refused("session_id", str(e)) from None
            seq = 0
        else:
            if req.model_id is None or req.seq_id is None:
                raise _refused("model_id", "a load names model_id and seq_id, or session_id and model_seq_id")
            rec, seq = _model(r, req.model_id), req.seq_id
        call = TinkerCall(
            job_id="",
            seq=seq,
            kind="load_state",
            request_id="",
            name=parsed[2],
            source_job=source or "",
            optimizer=req.optimizer,
        )
        return _submit(r, rec, call)

    return router


def sampling_router(r: redis.Redis) -> APIRouter:
    router = APIRouter(tags=["tinker"])
    context = _context_cache(r)

    def resolve(sampler_id: str) -> tuple[JobRecord, int]:
        job, sep, v = sampler_id.rpartition(".v")
        rec = load_job(r, job) if sep and v.isdigit() else None
        if rec is None or not rec.spec.tinker:
            raise HTTPException(404, f"no sampling session {sampler_id!r}")
        return rec, int(v)

    @router.post("/create_sampling_session")
    def create_sampling_session(req: CreateSamplingSessionRequest) -> dict[str, Any]:
        if req.model_path is None:
            raise _refused("model_path", "sampling the bare base model is not served: sample a saved model's path")
        parsed = parse_path(req.model_path)
        if parsed is None or parsed[1] != "sampler_weights":
            raise _refused("model_path", "a tinker://<model_id>/sampler_weights/<name> path")
        rec = _model(r, parsed[0])
        version = r.hget(keys.tinker_state(rec.id), f"sampler:{parsed[2]}")
        if version is None:
            raise HTTPException(404, f"no sampler weights {req.model_path!r}")
        return {"type": "create_sampling_session", "sampling_session_id": calls.sampler_id(rec.id, int(version))}

    @router.get("/samplers/{sampler_id}")
    def get_sampler(sampler_id: str) -> dict[str, Any]:
        rec, version = resolve(sampler_id)
        return {"sampler_id": sampler_id, "base_model": rec.spec.base_model, "model_path": None}

    @router.post("/asample")
    def asample(req: SampleRequest) -> dict[str, Any]:
        if req.sampling_session_id is None:
            raise _refused("sampling_session_id", "sample through a sampling client of a saved model")
        rec, version = resolve(req.sampling_session_id)
        tokens = [t for c in req.prompt.chunks for t in c.tokens]
        ctx = context(rec)
        p = req.sampling_params
        max_tokens = p.max_tokens or 16
        if ctx and len(tokens) + max_tokens > ctx:
            raise _refused(
                "prompt", f"{len(tokens)} prompt tokens + max_tokens {max_tokens} exceed the model's context of {ctx}"
            )
        if version > read_pointer(r, rec.id):
            raise HTTPException(409, f"policy v{version} of this model is not published yet")
        stop = p.stop if isinstance(p.stop, list) else ([p.stop] if p.stop else [])
        call = SampleCall(
            job_id="",
            request_id="",
            version=version,
            prompt=np.asarray(tokens, dtype="<i4").tobytes(),
            num_samples=req.num_samples,
            max_tokens=max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            stop=[s for s in stop if isinstance(s, str)],
            stop_tokens=[s for s in stop if isinstance(s, int)],
            prompt_logprobs=bool(req.prompt_logprobs),
        )
        return calls.submit_sample(r, rec, call)

    return router


def futures_router(r: redis.Redis, ar: redis.asyncio.Redis) -> APIRouter:
    router = APIRouter(tags=["tinker"])

    @router.post("/retrieve_future")
    async def retrieve_future(req: FutureRetrieveRequest) -> Response:
        if req.request_id.endswith(".create"):  # create_model: done when it answered
            job = req.request_id[: -len(".create")]
            return JSONResponse({"type": "create_model", "model_id": _model_id_of(job)})
        try:
            ans = await calls.retrieve(r, ar, req.request_id)
        except calls.UnknownRequest as e:
            raise HTTPException(404, str(e.args[0])) from None
        if ans.proto is not None:
            return Response(ans.proto, media_type=calls.PROTOBUF)
        return JSONResponse(ans.json, status_code=ans.status)

    @router.post("/cancel_future")
    def cancel_future(req: CancelRequest) -> dict[str, Any]:
        return {}  # sample calls are short; a cancelled one finishes and its result is never read

    return router


def _model_id_of(job: str) -> str:
    try:
        return model_of_job(job)
    except ValueError:
        raise HTTPException(404, f"no request {job}.create") from None


def install(rt: ServiceRuntime, app: FastAPI | None = None) -> None:
    """Mount the Tinker API on the api's app, under /api/v1."""
    app = app or rt.app
    r = rt.redis
    ar = connect_async(rt.settings.redis_url, longest_block_s=calls.POLL_S)
    auth = [Depends(api_key_auth(rt.settings))]
    rt.guard(PREFIX + "/", lambda headers: key_refusal(rt.settings, headers.get("x-api-key")))
    for router in (service_router(r), training_router(r), sampling_router(r), futures_router(r, ar)):
        app.include_router(router, prefix=PREFIX, dependencies=auth)
