"""Every service's HTTP answers stay small, valid and encodable, whatever the request held.

ServiceRuntime installs this on every app (api, reward, rollout, ref, trainer), so it is the one
place where a 4xx body is made:
- a 422 lists at most ERROR_LIST_MAX errors and then says how many more there were (100,000
  unknown keys in an 800 kB body made a 9.7 MB answer);
- an echoed input is cut to ERROR_INPUT_MAX_CHARS and a NaN becomes text (a NaN made the 422
  itself unserialisable);
- no answer fails to encode: a lone surrogate in any string is sent as U+FFFD;
- a request body holding a lone surrogate escape ("\\ud800") is refused with a 422 that says
  so, as it streams in: Python's JSON parser accepts the escape, and nothing downstream can store,
  echo or log the text it makes (a 500, or a reset connection).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi import HTTPException as FastAPIHTTPException  # its detail may be a list of errors
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.limits import ERROR_INPUT_MAX_CHARS, ERROR_LIST_MAX
from shared.text import valid_text


def encodable(value: Any) -> Any:
    """JSON data with every lone surrogate in its strings (keys too) shown as U+FFFD."""
    if isinstance(value, str):
        return valid_text(value)[0]
    if isinstance(value, dict):
        return {encodable(k): encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encodable(v) for v in value]
    return value


class SafeJSONResponse(JSONResponse):
    """JSONResponse whose body always encodes: a lone surrogate anywhere is sent as U+FFFD."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return super().render(encodable(content))


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
    """pydantic/FastAPI error dicts, at most ERROR_LIST_MAX of them (then one saying how many
    more), with `input` and `ctx` cut down to JSON-safe, short values."""
    errors = list(errors)
    out = []
    for err in errors[:ERROR_LIST_MAX]:
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
    if len(errors) > ERROR_LIST_MAX:
        more = len(errors) - ERROR_LIST_MAX
        out.append(
            {
                "type": "too_many_errors",
                "loc": ["body"],
                "msg": f"{more} more errors not listed (at most {ERROR_LIST_MAX} are); fix these and send it again",
                "ctx": {"not_listed": more},
            }
        )
    return out


def _is_error_list(detail: Any) -> bool:
    return isinstance(detail, list) and all(isinstance(e, dict) for e in detail)


# -- lone surrogate escapes in a request body --------------------------------------------
# A JSON escape, taken left to right so that "\\\\" is one escape and the "u" after it is text.
_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|(.))", re.DOTALL)


def _surrogate(hexdigits: bytes | None) -> str:
    """ "high", "low" or "" for the four hex digits of a \\u escape (None: another escape)."""
    if hexdigits is None:
        return ""
    code = int(hexdigits, 16)
    return "high" if 0xD800 <= code <= 0xDBFF else "low" if 0xDC00 <= code <= 0xDFFF else ""


class LoneSurrogate(FastAPIHTTPException):
    """Raised from `receive` when the body holds a lone surrogate escape: an HTTPException, so
    FastAPI's body reader passes it on to the handler below, which answers 422."""

    def __init__(self, escape: bytes, offset: int) -> None:
        shown = escape.decode("ascii", "replace")
        super().__init__(
            422,
            [
                {
                    "type": "lone_surrogate",
                    "loc": ["body"],
                    "msg": f"the body holds the escape {shown} at byte {offset}, half of a surrogate pair: not "
                    "valid Unicode text. Send UTF-8 text, or both halves of the pair for a character beyond U+FFFF",
                    "ctx": {"escape": shown, "offset": offset},
                }
            ],
        )


class SurrogateScanner:
    """Finds the first lone surrogate escape in a body that arrives in chunks, holding back only
    the few bytes of an escape (or of a pair's first half) that a chunk's end may have cut."""

    def __init__(self) -> None:
        self.carry = b""
        self.offset = 0  # where `carry` starts in the body

    def feed(self, chunk: bytes, last: bool) -> LoneSurrogate | None:
        buf = self.carry + chunk
        cut = len(buf)  # where the part to look at again with the next chunk starts
        escapes = []
        for m in _ESCAPE.finditer(buf):
            if not last and m.group(2) == b"u" and len(buf) - m.start() < 6:
                cut = m.start()  # "\\u" with its hex digits still to come
                break
            escapes.append(m)
        else:
            tail = buf.find(b"\\", escapes[-1].end() if escapes else 0)
            if tail != -1 and not last:  # a backslash as the very last byte
                cut = tail
        high: re.Match[bytes] | None = None  # a pair's first half, waiting for its second
        for m in escapes:
            kind = _surrogate(m.group(1))
            if high is not None:
                if kind == "low" and m.start() == high.end():
                    high = None
                    continue
                return LoneSurrogate(high.group(0), self.offset + high.start())
            if kind == "low":
                return LoneSurrogate(m.group(0), self.offset + m.start())
            high = m if kind == "high" else None
        if high is not None:
            if last or high.end() != cut:
                return LoneSurrogate(high.group(0), self.offset + high.start())
            cut = high.start()  # its second half may start the next chunk
        self.offset += cut
        self.carry = buf[cut:]
        return None


class StrictUnicodeBody:
    """Pure ASGI middleware: a 422 for a body holding a lone surrogate escape, found as it
    streams in (nothing is buffered beyond a dozen bytes; nothing is parsed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scanner = SurrogateScanner()
        started = False

        async def checking_receive() -> Message:
            msg = await receive()
            if msg["type"] == "http.request":
                refused = scanner.feed(msg.get("body", b""), last=not msg.get("more_body", False))
                if refused is not None:
                    raise refused
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, checking_receive, tracking_send)
        except LoneSurrogate as e:  # raised where no handler answered it
            if started:
                raise
            await SafeJSONResponse({"detail": e.detail}, status_code=e.status_code)(scope, receive, send)


def install(app: FastAPI) -> None:
    """The handlers that make every error answer small and encodable, and the body check."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return SafeJSONResponse({"detail": small_errors(exc.errors())}, status_code=422)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        headers = getattr(exc, "headers", None)
        if exc.status_code < 200 or exc.status_code in (204, 304):  # no body allowed
            return Response(status_code=exc.status_code, headers=headers)
        detail = small_errors(exc.detail) if _is_error_list(exc.detail) else exc.detail
        return SafeJSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)

    app.add_middleware(StrictUnicodeBody)
