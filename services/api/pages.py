"""Page cursors of `GET /v1/jobs`: opaque to clients, signed, so the api never trusts one it did
not issue.

A cursor carries the index member of the last job of its page (shared/job.py, `index_member`)
and the state filter it was issued under, then an HMAC-SHA256 over both with a key kept in
Redis (keys.page_key, made once per dataset). A cursor whose signature does not hold was
forged, cut, or issued before Redis lost its data (the key went with it): a 422 naming
`cursor`. So is one issued for another `state`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets

import redis

from shared import keys

SIGNATURE_BYTES = 16
CURSOR_MAX = 512  # characters: a member is under 100, so a real cursor is well under this


class BadCursor(ValueError):
    """A cursor this api did not issue, or issued for another query."""


def _key(r: redis.Redis) -> bytes:
    """The signing key: made on first use (SET NX, so every api replica shares the first one)."""
    r.set(keys.page_key(), secrets.token_hex(32), nx=True)
    raw = r.get(keys.page_key())
    assert raw is not None  # just set, and never deleted but with the dataset
    return raw


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue(r: redis.Redis, *, member: str, state: str) -> str:
    body = json.dumps({"m": member, "s": state}, separators=(",", ":")).encode()
    sig = hmac.new(_key(r), body, hashlib.sha256).digest()[:SIGNATURE_BYTES]
    return f"{_b64(body)}.{_b64(sig)}"


def read(r: redis.Redis, cursor: str, *, state: str) -> str:
    """The member a cursor continues after; BadCursor (with what to do) if it is not one of ours
    for this query."""
    body_text, _, sig_text = cursor.partition(".")
    try:
        body, sig = _unb64(body_text), _unb64(sig_text)
    except (binascii.Error, ValueError):
        raise BadCursor("not a cursor this api issued (it is not base64url): start again without it") from None
    want = hmac.new(_key(r), body, hashlib.sha256).digest()[:SIGNATURE_BYTES]
    if not hmac.compare_digest(sig, want):
        raise BadCursor(
            "not a cursor this api issued, or a stale one (from before Redis lost its data): start again without it"
        )
    fields = json.loads(body)  # ours: signed above
    if fields["s"] != state:
        raise BadCursor(
            f"issued for state={fields['s'] or '(any)'}, not state={state or '(any)'}: "
            "repeat the query it came from, or start again without it"
        )
    return str(fields["m"])
