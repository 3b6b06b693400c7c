"""The agent endpoint's HTTP surface on the rollout service (docs/agents.md), behind the token.

    POST /v1/jobs/{job}/groups                                    open a group of G episodes
    POST /v1/jobs/{job}/episodes/{ep}/openai/v1/chat/completions  a chat turn (OpenAI shape)
    POST /v1/jobs/{job}/episodes/{ep}/openai/v1/completions       a completion turn
    POST /v1/jobs/{job}/openai/v1/{chat/completions,completions}  the same, episode in X-Burstrl-Episode
    GET  /v1/jobs/{job}/episodes/{ep}/openai/v1/models            the model the episode runs on
    POST /v1/jobs/{job}/episodes/{ep}/reward                      close it with a reward
    POST /v1/jobs/{job}/episodes/{ep}/verify                      close it for the job's verifiers
    GET  /v1/jobs/{job}/episodes/{ep}                             what it recorded so far

`openai.OpenAI(base_url=<rollout>/v1/jobs/{job}/episodes/{ep}/openai/v1, api_key=<token>)`
works as is: the client's api key is the bearer token. Bodies are read with a size bound
before they are parsed (413), then validated against the bounds of shared/limits.py (422
naming the field).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from services.rollout.agent_episodes import AgentError
from services.rollout.agents import AgentServer
from shared.http_errors import SafeJSONResponse, small_errors
from shared.limits import (
    ARG_STR_MAX,
    CHAT_BODY_MAX_BYTES,
    CHAT_CONTENT_MAX_CHARS,
    CHAT_MESSAGES_MAX,
    CHAT_TOOLS_MAX,
    FIELDS_MAX,
    NAME_MAX,
    STOP_MAX_CHARS,
    STOP_MAX_ITEMS,
    Shown,
)
from shared.service import ServiceRuntime

EPISODE_HEADER = "X-Burstrl-Episode"

Content = Annotated[str, StringConstraints(max_length=CHAT_CONTENT_MAX_CHARS)]
Stop = Annotated[str, StringConstraints(max_length=STOP_MAX_CHARS)]
Id = Annotated[str, StringConstraints(max_length=NAME_MAX * 2)]


class _Open(BaseModel):
    """OpenAI bodies carry many optional fields; the ones not named here are ignored unless
    `_refuse_changed_sampling` says they change what the policy samples."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Content


class ToolFunction(BaseModel):
    name: Annotated[str, StringConstraints(max_length=NAME_MAX)]
    arguments: Content = ""


class ToolCall(BaseModel):
    id: Id = ""
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | Annotated[list[TextPart], Field(max_length=CHAT_MESSAGES_MAX)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=CHAT_TOOLS_MAX)] | None = None
    tool_call_id: Id | None = None
    name: Annotated[str, StringConstraints(max_length=NAME_MAX)] | None = None


class _Sampling(_Open):
    model: Annotated[str, StringConstraints(max_length=1024)] = ""
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = Field(
        None, description="One choice per turn: an episode is one path."
    )
    stream: Literal[False] | None = Field(None, description="Streaming is not served.")
    stop: Stop | Annotated[list[Stop], Field(max_length=STOP_MAX_ITEMS)] | None = None

    @model_validator(mode="after")
    def _refuse_changed_sampling(self) -> _Sampling:
        # Penalties and biases change the distribution tokens are drawn from: the log-probs the
        # trainer corrects with would not be the sampler's.
        extra = self.model_extra or {}
        for k in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if extra.get(k) not in (None, 0, 0.0):
                raise ValueError(f"{k}: not served (it would change the policy's sampling distribution)")
        if extra.get("logit_bias"):
            raise ValueError("logit_bias: not served (it would change the policy's sampling distribution)")
        return self


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=CHAT_MESSAGES_MAX)]
    tools: Annotated[list[dict[str, Any]], Field(max_length=CHAT_TOOLS_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None


class CompletionRequest(_Sampling):
    prompt: Annotated[str, StringConstraints(min_length=1, max_length=CHAT_CONTENT_MAX_CHARS)]


class OpenGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fields: Annotated[
        dict[
            Annotated[str, StringConstraints(min_length=1, max_length=NAME_MAX), Shown],
            Annotated[str, StringConstraints(max_length=ARG_STR_MAX)],
        ],
        Field(max_length=FIELDS_MAX),
    ] = Field(default_factory=dict, description="Task fields the verifiers read (answer, ...), for /verify.")


class Reward(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: Annotated[float, Field(ge=-1e6, le=1e6)] | None = None
    parts: (
        Annotated[
            dict[
                Annotated[str, StringConstraints(min_length=1, max_length=NAME_MAX), Shown],
                Annotated[float, Field(ge=-1e6, le=1e6)],
            ],
            Field(max_length=FIELDS_MAX),
        ]
        | None
    ) = None

    @model_validator(mode="after")
    def _one(self) -> Reward:
        if (self.reward is None) == (self.parts is None):
            raise ValueError("give reward (a number) or parts (name -> number), not both or neither")
        return self


class Verify(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answer: Annotated[str, StringConstraints(max_length=CHAT_CONTENT_MAX_CHARS)] | None = Field(
        None, description="What the verifiers score; default: the episode's last model turn."
    )


async def _body(request: Request, model: type[BaseModel]) -> Any:
    """The body, at most CHAT_BODY_MAX_BYTES (413 past it, before parsing), validated (422)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > CHAT_BODY_MAX_BYTES):
        raise AgentError(413, f"request body larger than {CHAT_BODY_MAX_BYTES} bytes (limits: shared/limits.py)")
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > CHAT_BODY_MAX_BYTES:
            raise AgentError(413, f"request body larger than {CHAT_BODY_MAX_BYTES} bytes (limits: shared/limits.py)")
    try:
        return model.model_validate_json(data or b"{}")
    except ValidationError as e:
        errors = _errors(e)
        why = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:])}: {err['msg']}" for err in errors)
        raise AgentError(422, why, errors) from None


def _errors(e: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors naming each field in the body, as small as every service's (a few,
    inputs cut: shared/http_errors.py)."""
    return small_errors({**err, "loc": ["body", *err["loc"]]} for err in e.errors(include_url=False))


def _checked_sampling(req: _Sampling, server: AgentServer, job_id: str) -> None:
    spec = server.served(job_id).rec.spec.sampling
    if req.temperature is not None and abs(req.temperature - spec.temperature) > 1e-6:
        raise AgentError(
            422,
            f"temperature: {req.temperature} is not the job's sampling.temperature {spec.temperature}; the "
            "trainer's log-probs assume the job's (leave it out)",
        )
    if req.top_p is not None and abs(req.top_p - spec.top_p) > 1e-6:
        raise AgentError(422, f"top_p: {req.top_p} is not the job's sampling.top_p {spec.top_p} (leave it out)")


def install(rt: ServiceRuntime, agents: Callable[[], AgentServer | None]) -> None:
    """The routes, from the service's start; `agents()` is None until the engine is up (503 meanwhile)."""
    router = APIRouter(prefix="/v1/jobs/{job_id}", dependencies=[rt.auth], tags=["agents"])

    async def call(name: str, *args: Any) -> Any:
        """`AgentServer.<name>(*args)` in a worker thread (it may wait for the engine); its refusals as HTTP."""
        srv = agents()
        if srv is None:
            raise AgentError(503, "rollout's engine is starting (see /readyz); try again")
        return await run_in_threadpool(getattr(srv, name), *args)

    async def call_checked(req: _Sampling, job_id: str) -> None:
        srv = agents()
        if srv is not None:
            _checked_sampling(req, srv, job_id)

    @router.post("/groups", status_code=201)
    async def open_group(job_id: str, request: Request) -> dict[str, Any]:
        """Open a group of group_size episodes (one task, G attempts); each has its own base URL."""
        body = await _body(request, OpenGroup)
        g = await call("open_group", job_id, body.fields)
        base = str(request.base_url).rstrip("/")
        return {
            "group": g.id,
            "deadline_at": g.deadline_at,
            "episodes": [
                {"id": e.id, "base_url": f"{base}/v1/jobs/{job_id}/episodes/{e.id}/openai/v1"} for e in g.episodes
            ],
        }

    @router.post("/episodes/{episode_id}/openai/v1/chat/completions")
    async def chat(job_id: str, episode_id: str, request: Request) -> dict[str, Any]:
        req = await _body(request, ChatRequest)
        await call_checked(req, job_id)
        return await call("chat", job_id, episode_id, req.model_dump(exclude_none=True))

    @router.post("/episodes/{episode_id}/openai/v1/completions")
    async def complete(job_id: str, episode_id: str, request: Request) -> dict[str, Any]:
        req = await _body(request, CompletionRequest)
        await call_checked(req, job_id)
        return await call("complete", job_id, episode_id, req.model_dump(exclude_none=True))

    # The same turns on one base URL per job, the episode named by a header, for clients that
    # share one client across episodes: openai.OpenAI(..., default_headers={EPISODE_HEADER: id}).
    def _named(request: Request) -> str:
        got = request.headers.get(EPISODE_HEADER, "")
        if not got:
            raise AgentError(422, f"header {EPISODE_HEADER}: required on /v1/jobs/{{job}}/openai/v1 (the episode id)")
        return got

    @router.post("/openai/v1/chat/completions")
    async def chat_by_header(job_id: str, request: Request) -> dict[str, Any]:
        return await chat(job_id, _named(request), request)

    @router.post("/openai/v1/completions")
    async def complete_by_header(job_id: str, request: Request) -> dict[str, Any]:
        return await complete(job_id, _named(request), request)

    @router.get("/episodes/{episode_id}/openai/v1/models")
    async def models(job_id: str, episode_id: str) -> dict[str, Any]:
        await call("episode", job_id, episode_id)
        return {"object": "list", "data": [{"id": job_id, "object": "model", "owned_by": "burstrl"}]}

    @router.post("/episodes/{episode_id}/reward")
    async def reward(job_id: str, episode_id: str, request: Request) -> dict[str, Any]:
        """Close the episode with its reward; the group's last close puts the group on the bus."""
        body = await _body(request, Reward)
        parts = body.parts if body.parts is not None else {"agent": float(body.reward)}  # type: ignore[arg-type]
        return await call("close", job_id, episode_id, "reward", parts, None)

    @router.post("/episodes/{episode_id}/verify")
    async def verify(job_id: str, episode_id: str, request: Request) -> dict[str, Any]:
        """Close the episode for the job's verifiers (the reward service scores the group)."""
        body = await _body(request, Verify)
        return await call("close", job_id, episode_id, "verify", {}, body.answer)

    @router.get("/episodes/{episode_id}")
    async def episode(job_id: str, episode_id: str) -> dict[str, Any]:
        return await call("status", job_id, episode_id)

    app: FastAPI = rt.app
    app.include_router(router)
    app.add_exception_handler(AgentError, _refused)  # type: ignore[arg-type]


async def _refused(_: Request, e: AgentError) -> JSONResponse:
    """A refusal both ways: FastAPI's `detail` and OpenAI's `error.message`, so an `openai`
    client's exception says why (it reads `error`)."""
    kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 413: "request_too_large"}
    body = {
        "detail": e.detail if e.detail is not None else e.reason,
        "error": {"message": e.reason, "type": kind.get(e.status, "invalid_request_error"), "code": e.status},
    }
    return SafeJSONResponse(body, status_code=e.status)
