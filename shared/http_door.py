"""The door every service's HTTP server keeps: how many may come in, how long each may take to
say what it wants, how much it may say, and that nobody unknown gets to say more than a head.

ServiceRuntime (shared/service.py) runs uvicorn for all five services with `server_config`.
Each bound is uvicorn's or h11's own setting where it has one (settings in shared/settings.py,
`http_*`):

- concurrent connections: uvicorn's `limit_concurrency`; past it uvicorn answers a request 503
  (it still accepts the socket: the head deadline below reaps the idle ones). The soft open-file
  limit is raised to the hard one at start (`raise_open_files`), so the bound, not EMFILE, is
  what a flood meets;
- keep-alive: uvicorn's `timeout_keep_alive` closes a connection idle after a response;
- the head's size: h11's `max_incomplete_event_size` (uvicorn's h11 protocol; httptools has no
  limit: a 100 MiB header was buffered whole). uvicorn answers every h11 error 400; `DoorProtocol`
  gives h11's own status hint instead, 431 for a head too large.

What uvicorn has no setting for, kept as small as it can be:

- a deadline for a request's head (`DoorProtocol`): uvicorn arms no timer before a first
  request, and cancels its keep-alive timer on every byte, so a socket that sends nothing, or a
  header a byte at a time, was held forever;
- a deadline for the body (`BodyDeadline`): 408 and the connection closed;
- the token, checked from the head before anything reads the body (`TokenGate`): FastAPI reads
  and parses a body before it runs a route's dependencies, so an unauthenticated 200 MiB body
  was read whole (the reward service went from 84 to 652 MB).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import time
from collections.abc import Callable, Iterable
from typing import Any

import h11
import uvicorn
from fastapi import HTTPException
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# Files a service holds beside its connections: Redis pools, the store's client, logs, a model.
FILES_BESIDE_CONNECTIONS = 512


def raise_open_files(need: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the common default soft limit, 1,024, is
    less than the connections a service holds: past it every accept and every new Redis
    connection fails with EMFILE); say so, and warn when even the hard limit is below `need`.
    Returns (soft before, soft now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if now < need:
        log.warning(
            "open files: limit %d (hard %d) is below the %d this service may need (http_max_connections + %d): "
            "raise the hard limit (compose `ulimits: nofile`, systemd LimitNOFILE; deploy/README.md)",
            now,
            hard,
            need,
            FILES_BESIDE_CONNECTIONS,
        )
    else:
        log.info("open files: soft limit %d (was %d, hard %d)", now, soft, hard)
    return soft, now


class _Connection(h11.Connection):
    """h11's connection, remembering why it refused the client's bytes (uvicorn does not say)."""

    refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.refused = e
            raise


class DoorProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for every request's head, counted from the
    connection's start or the end of the previous response (bytes arriving do not extend it),
    and h11's status hint (431 for a head too large) where uvicorn answers 400."""

    def __init__(self, *args: Any, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(
            h11.SERVER, self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        )
        self.head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._awaiting_after: object = None  # the cycle whose successor's head is awaited

    def _await_head(self) -> None:
        self._stop_head_timer()
        self._awaiting_after = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.logger.debug("request head not received within %.1fs: connection closed", self.head_timeout_s)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._awaiting_after:
            self._stop_head_timer()  # a new request's head came in whole

    def on_response_complete(self) -> None:
        self._await_head()  # before uvicorn runs a pipelined request: its head is then in
        super().on_response_complete()
        if self.cycle is not self._awaiting_after:
            self._stop_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        refused, self.conn.refused = self.conn.refused, None
        status = refused.error_status_hint if refused is not None else 400
        if status == 400:
            super().send_400_response(msg)
            return
        text = f"request head refused: {refused}".encode()
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=text), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class TokenGate:
    """Pure ASGI: a request whose head carries no valid credential for its path is answered from
    the head, before anything reads its body. `refusal(path, headers)` is None to let it in, else
    the HTTPException to answer (401: the route's own dependency raises the same one, and keeps
    the route closed whatever the gate lets by)."""

    def __init__(self, app: ASGIApp, *, refusal: Callable[[str, Headers], HTTPException | None]) -> None:
        self.app, self.refusal = app, refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (no := self.refusal(scope["path"], Headers(scope=scope))) is not None:
            answer = JSONResponse({"detail": no.detail}, no.status_code, headers=no.headers)
            await answer(scope, receive, send)  # reads nothing of the body
            return
        await self.app(scope, receive, send)


class BodyTimeout(HTTPException):
    """Raised from `receive` once the body is overdue: an HTTPException, so FastAPI's body reader
    passes it on (it turns other errors into a 400); `Connection: close` makes uvicorn close the
    connection after the answer instead of reading on."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408, f"request body not received whole within {timeout_s:g} s", headers={"Connection": "close"}
        )


class BodyDeadline:
    """Pure ASGI: the whole body must arrive within `timeout_s` of the request's head."""

    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout_s
        done = False

        async def timed_receive() -> Message:
            nonlocal done
            if done:  # the body is in: what is left to wait for is a disconnect, not ours to time
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            done = msg["type"] != "http.request" or not msg.get("more_body", False)
            return msg

        await self.app(scope, timed_receive, send)


def public_paths(paths: Iterable[str], mounts: Iterable[str] = ()) -> Callable[[str], bool]:
    """A path test: one of `paths` exactly, or under one of `mounts` (folders of static files)."""
    exact, under = frozenset(paths), tuple(m.rstrip("/") + "/" for m in mounts)
    return lambda path: path in exact or path.startswith(under)


def server_config(app: ASGIApp, settings: Any, *, host: str, port: int) -> uvicorn.Config:
    """uvicorn's configuration for a service: its door bounds from `settings` (CommonSettings)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        http=functools.partial(DoorProtocol, head_timeout_s=settings.http_head_timeout_s),  # type: ignore[arg-type]
        limit_concurrency=settings.http_max_connections,
        timeout_keep_alive=settings.http_keep_alive_s,
        h11_max_incomplete_event_size=settings.http_header_max_bytes,
    )
