"""The api's door: a body-size limit enforced before parsing, and 422s that stay small and valid.

A 10 MB body used to be parsed, validated and echoed back whole in the 422, holding the
event loop (and /healthz) for seconds; a NaN in a body made the 422 itself unserialisable
(a 500, then a reset connection). Limits are in shared/limits.py.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.limits import BODY_MAX_BYTES, ERROR_INPUT_MAX_CHARS


def too_large_message(limit: int) -> str:
    return f"request body larger than {limit} bytes; a job spec is a few kB (limits: shared/limits.py)"


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body crosses the limit: an HTTPException, so FastAPI's
    body reader passes it on (it turns other errors into a 400) and the app answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over `max_bytes`, counted as it streams in.

    A declared Content-Length over the limit is refused before a byte of the body is
    read; a chunked body is counted chunk by chunk and refused once it crosses the limit.
    Nothing is buffered or parsed here, so the event loop stays free for other requests.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = BODY_MAX_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": too_large_message(self.max_bytes)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                # No "connection: close": uvicorn then discards the rest of the body as it
                # arrives (never buffered, never parsed), so a client that writes its whole
                # body before reading (most do) still gets this answer, not a reset.
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _small(value: Any) -> Any:
    """`value` if it is small and valid JSON, else a short description of it."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):  # NaN, an infinity, or not JSON at all
        text = None
    if text is not None and len(text) <= ERROR_INPUT_MAX_CHARS:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "nan": JSON has no literal for them
    shown = repr(value)
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(shown)} characters as text"
    return f"{shown[:ERROR_INPUT_MAX_CHARS]}... ({type(value).__name__}, {size}; cut)"


def small_errors(errors: Any) -> list[dict[str, Any]]:
    """pydantic/FastAPI error dicts with `input` and `ctx` cut down to JSON-safe, short values."""
    out = []
    for err in errors:
        e = {k: v for k, v in err.items() if k not in ("input", "ctx", "url")}
        e["loc"] = [x if isinstance(x, int | str) else str(x) for x in err.get("loc", ())]
        if "input" in err:
            e["input"] = _small(err["input"])
        if isinstance(err.get("ctx"), dict):
            e["ctx"] = {
                k: _small(v if isinstance(v, int | float | str | bool | None) else str(v))
                for k, v in err["ctx"].items()
            }
        out.append(e)
    return out


def install(app: FastAPI, max_bytes: int = BODY_MAX_BYTES) -> None:
    """The body limit (outermost, before anything reads the body) and the small-422 handler."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": small_errors(exc.errors())}, status_code=422)

    app.add_middleware(BodyLimit, max_bytes=max_bytes)
