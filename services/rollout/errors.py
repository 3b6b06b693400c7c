"""Rollout's error taxonomy: what went wrong decides what happens next.

| error | raised when | what rollout does |
|---|---|---|
| EngineUnavailable | the engine is not built, unreachable, died, or refuses our credentials | not ready, with the reason; entries stay pending; retried |
| AdapterError | the engine refuses a version's adapter or full weights | the version is refused ("load") |
| EngineRequestRefused (a RequestFailed) | the engine refuses one request (a remote 4xx, a prompt vLLM rejects) | see below |
| MissingLogprob (a RequestFailed) | the engine answers without a sampled token's log-prob | see below |
| ManifestError | a version's manifest is missing or malformed | the version is refused ("manifest") |
| VerificationError | a file's sha256 differs from its manifest | refused ("hash") |
| DeposedWrite | a trainer wrote the version after losing its job | refused ("deposed") |
| ProbeMismatch | the engine's log-probs under the version differ from the trainer's | refused ("probe") |
| UnsupportedVersion | full weights for an engine that cannot load them | refused ("unsupported") |

A RequestFailed in a generation round produces no group for that prompt (the others of the
call are produced): the prompt is redone, and dead-lettered with the reason after the bus's
max deliveries. During adoption (the probe) it refuses the version ("engine").

A refusal lasts as long as the version's manifest does: a republished version (a new
manifest) is tried again. Anything else, a ValueError or KeyError included, is a bug: it
propagates, and the service loop logs it with its traceback and counts it.
"""

from __future__ import annotations

from shared.policy import DeposedWrite, ManifestError, ProbeMismatch
from shared.store import StoreError, VerificationError

__all__ = [
    "LORA_HELP",
    "AdapterError",
    "DeposedWrite",
    "EngineRequestRefused",
    "EngineUnavailable",
    "ManifestError",
    "MissingLogprob",
    "ProbeMismatch",
    "RequestFailed",
    "UnsupportedVersion",
    "VerificationError",
    "VersionRefused",
    "refusal_kind",
]


# What a refusal says when an engine cannot run LoRA adapters (none is verified on gfx906 cards).
LORA_HELP = "see deploy/README.md, 'When adapters fail on your cards'"


class EngineUnavailable(RuntimeError):
    """The engine cannot serve right now (not built, unreachable, died). Transient: retry later."""


class AdapterError(RuntimeError):
    """The engine refused an adapter (bad format, rank too large, wrong base). Permanent for that version."""


class RequestFailed(RuntimeError):
    """One request of an engine call gave nothing usable. `index`: its position in the call
    (None: the engine did not say which), so the caller can keep the others' results."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class EngineRequestRefused(RequestFailed):
    """The engine refused a request (a remote server's 4xx, a prompt vLLM's input checks reject)."""


class MissingLogprob(RequestFailed):
    """The engine answered without the log-prob of a sampled token: never trained on a made-up one."""


class UnsupportedVersion(RuntimeError):
    """A version this engine cannot load at all (full weights on a remote server)."""


# The refusals a version can earn, most specific first (DeposedWrite and ProbeMismatch are
# VerificationErrors; ManifestError is a StoreError).
_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (DeposedWrite, "deposed"),
    (ProbeMismatch, "probe"),
    (VerificationError, "hash"),
    (ManifestError, "manifest"),
    (StoreError, "manifest"),  # a file the manifest names is not in the store
    (AdapterError, "load"),
    (RequestFailed, "engine"),
    (UnsupportedVersion, "unsupported"),
)
VersionRefused = tuple(t for t, _ in _KINDS)  # `except VersionRefused`: everything that refuses a version


def refusal_kind(e: BaseException) -> str:
    """The metric label of a refused version (burstrl_rollout_verify_failures{kind})."""
    for t, kind in _KINDS:
        if isinstance(e, t):
            return kind
    raise TypeError(f"{type(e).__name__} does not refuse a version") from e
