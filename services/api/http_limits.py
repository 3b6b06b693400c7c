"""The api's door: a body-size limit enforced before parsing.

A 10 MB body used to be parsed, validated and echoed back whole in the 422, holding the
event loop (and /healthz) for seconds. Limits are in shared/limits.py; the 422s that stay
small and valid are every service's (shared/http_errors.py).
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.limits import BODY_MAX_BYTES


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


def install(app: FastAPI, max_bytes: int = BODY_MAX_BYTES) -> None:
    """The body limit: before anything reads the body, but inside the door's token gate
    (shared/http_door.py), so a client without the token hears 401, never a limit. (The small,
    encodable error answers every service gives are shared/http_errors.py's, installed by
    ServiceRuntime.)"""
    app.user_middleware.append(Middleware(BodyLimit, max_bytes=max_bytes))  # innermost; add_middleware: outermost
