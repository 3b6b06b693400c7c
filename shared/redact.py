"""Secrets never appear in errors or logs.

A service's secrets come from its environment: the bearer token, the password in REDIS_URL, the
object store's credentials, a remote engine's API key. Three ways they leaked, each closed here
or beside it:
- a settings error echoed every input (pydantic's `input_value`), the first characters of the
  Redis password included: every settings model sets `hide_input_in_errors`;
- a URL with credentials in a message (a STORE_URL, a remote engine's URL): `redact_url`;
- anything else that formats a secret into a log line, a traceback or a readiness reason (which
  /readyz shows without a token): `install` puts a filter on the root logger's handlers and an
  excepthook that replace each secret value with `***`, and `scrub` does it for the health checks.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from types import TracebackType
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"
_installed: list[str] = []  # this process's secrets, once `install` ran
MIN_SECRET = 4  # shorter values are not secrets worth masking (masking "a" would garble every line)
# Environment variables that hold a secret outright, and those that hold a URL whose userinfo may.
SECRET_VARS = ("BURSTRL_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
SECRET_SUFFIXES = ("_API_KEY", "_PASSWORD", "_SECRET")
URL_VARS = ("REDIS_URL", "STORE_URL")  # and every other *_URL (a remote engine's): their userinfo's password


def redact_url(url: str) -> str:
    """`url` with the password of its userinfo (if any) replaced by ***."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{host}"))
    except ValueError:  # not a URL we can take apart: say nothing of it
        return MASK


def secret_values(env: Mapping[str, str]) -> list[str]:
    """The secret values in `env`, longest first (so a secret containing another is masked whole)."""
    out = set()
    for name, value in env.items():
        if name in SECRET_VARS or name.endswith(SECRET_SUFFIXES):
            out.add(value)
    for name in (n for n in env if n in URL_VARS or n.endswith("_URL")):
        try:
            password = urlsplit(env[name]).password
        except ValueError:
            continue
        if password:
            out.update({password, unquote(password)})
    return sorted((v for v in out if len(v) >= MIN_SECRET), key=len, reverse=True)


def mask(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        text = text.replace(s, MASK)
    return text


def scrub(text: str) -> str:
    """`text` with this process's secrets masked (those `install` found; none before it ran)."""
    return mask(text, _installed) if _installed else text


class SecretFilter(logging.Filter):
    """Replaces each secret value in a record's message and traceback with ***."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        message = record.getMessage()
        masked = mask(message, self.secrets)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and record.exc_info[1] is not None:
            # Formatted here, masked, and kept as the record's text: the handler prints exc_text as is.
            record.exc_text = mask(logging.Formatter().formatException(record.exc_info), self.secrets)
            record.exc_info = None
        return True


def install(env: Mapping[str, str] | None = None) -> None:
    """Mask the process's secrets in every log line (the root logger's handlers) and in an
    uncaught exception's traceback. Call after logging is configured."""
    secrets = secret_values(os.environ if env is None else env)
    _installed[:] = secrets
    if not secrets:
        return
    filt = SecretFilter(secrets)
    for handler in logging.getLogger().handlers:
        handler.addFilter(filt)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        import traceback

        text = "".join(traceback.format_exception(kind, value, tb))
        if mask(text, secrets) == text:
            previous(kind, value, tb)
        else:
            sys.stderr.write(mask(text, secrets))

    sys.excepthook = hook
