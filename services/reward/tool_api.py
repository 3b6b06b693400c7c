"""The reward service's python tool: `POST /v1/sandbox/run` runs one program in the code sandbox.

Why here: the reward service already hosts the sandbox (namespaces, uid pool, the
unconfined seccomp its container needs for them), so tool calls of the "python"
environment (shared/domain/envs/python_tool.py) run on that same isolation instead of the
rollout box growing a second one. The caller chooses the code, its stdin and a
timeout (capped by BURSTRL_REWARD_TOOL_MAX_TIMEOUT_S); every other limit (memory,
output, processes) is the service's. The route is behind the bearer token like every
non-health route.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from fastapi import APIRouter, HTTPException
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from services.reward.settings import RewardSettings
from shared.domain.sandbox import Limits, SandboxUnavailable, check_isolation, run_program
from shared.service import ServiceRuntime

MAX_CODE_CHARS = 16 * 1024
MAX_STDIN_CHARS = 64 * 1024
# Absolute ceiling of the schema; the service's own cap (a setting, at most this) is checked per request.
TIMEOUT_CEILING_S = 120.0


class SandboxRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(..., max_length=MAX_CODE_CHARS, description="Python source, run as a program.")
    stdin: str = Field("", max_length=MAX_STDIN_CHARS, description="The program's standard input.")
    timeout_s: float = Field(
        3.0, gt=0, le=TIMEOUT_CEILING_S, description="Wall-clock limit of the run (at most the service's cap)."
    )


class SandboxRunResponse(BaseModel):
    stdout: str = Field(description="What the program printed (capped by the service).")
    reason: str = Field(description='How it ended: "ok", "runtime_error:Kind", "wall_time_limit", "output_limit", ...')
    detail: str = Field(description="For errors, e.g. the exception's last traceback line.")
    seconds: float
    replaced: int = Field(0, description="Characters of stdout that were not valid UTF-8, each shown as U+FFFD.")


def tool_limits(settings: RewardSettings, timeout_s: float) -> Limits:
    """The service's limits for one run; only the wall clock comes from the caller."""
    return Limits.for_program(timeout_s, settings.tool_max_output, memory_mb=settings.tool_memory_mb)


def _too_long_timeout(value: float, cap: float) -> HTTPException:
    # The shape of FastAPI's own validation errors, so a client handles both the same way.
    return HTTPException(
        422,
        [
            {
                "type": "less_than_equal",
                "loc": ["body", "timeout_s"],
                "msg": f"Input should be less than or equal to {cap} (BURSTRL_REWARD_TOOL_MAX_TIMEOUT_S)",
                "input": value,
                "ctx": {"le": cap},
            }
        ],
    )


def add_tool_routes(rt: ServiceRuntime, settings: RewardSettings) -> None:
    """Add /v1/sandbox/run to the service's HTTP app (call before rt.start())."""
    runs = Counter(
        "burstrl_reward_tool_runs",
        "Python tool runs (/v1/sandbox/run) by outcome: ok, runtime_error, wall_time_limit, ..., busy, unavailable",
        ["reason"],
        registry=rt.registry,
    )
    cap = min(settings.tool_max_timeout_s, TIMEOUT_CEILING_S)
    # Bounds concurrent sandboxes (each is a process tree with its own memory limit); waiters
    # queue in the event loop, not in the threadpool that also serves /healthz and /metrics.
    slots = asyncio.Semaphore(settings.tool_concurrency)
    router = APIRouter(prefix="/v1", dependencies=[rt.auth])

    @router.post(
        "/sandbox/run",
        tags=["tools"],
        responses={
            422: {"description": "Invalid request (the field is named)"},
            503: {"description": "Sandbox unavailable on this host, or busy (retry)"},
        },
    )
    async def sandbox_run(req: SandboxRunRequest) -> SandboxRunResponse:
        """Run `code` once, isolated, on `stdin`; returns what it printed and how it ended."""
        if req.timeout_s > cap:
            raise _too_long_timeout(req.timeout_s, cap)
        ok, why = await run_in_threadpool(check_isolation)  # cached after the first probe
        if not ok:
            runs.labels("unavailable").inc()
            raise HTTPException(503, f"sandbox unavailable: {why}")
        try:
            # A run waits at most as long as the longest run may take, then the caller hears "busy".
            async with asyncio.timeout(cap):
                await slots.acquire()
        except TimeoutError:
            runs.labels("busy").inc()
            raise HTTPException(503, "sandbox busy: all tool slots in use", {"Retry-After": "1"}) from None
        try:
            res = await run_in_threadpool(run_program, req.code, req.stdin, tool_limits(settings, req.timeout_s))
        except SandboxUnavailable as e:
            runs.labels("unavailable").inc()
            raise HTTPException(503, f"sandbox unavailable: {e}") from None
        finally:
            slots.release()
        # Label by the reason's kind only: "runtime_error:<Kind>" names a class the caller's code
        # chose, and a label per name would let callers grow the metric without bound.
        runs.labels(res.reason.split(":", 1)[0]).inc()
        return SandboxRunResponse(**asdict(res))

    rt.app.include_router(router)
