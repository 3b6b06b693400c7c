"""Text verifiers: exact match, regex/format checks, DAPO's overlong length shaping."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from shared.domain.verifiers.registry import Scored, VerifierError, register_verifier


def _need(value: object, name: str, verifier: str) -> str:
    if value is None:
        raise VerifierError(f"verifier {verifier!r} needs a task field or arg {name!r}")
    return str(value)


@register_verifier("exact")
def exact(
    completions: Sequence[str],
    answer: str | None = None,
    strip: bool = True,
    case_sensitive: bool = True,
    **_: object,
) -> list[float]:
    """1.0 when the completion equals the `answer` field (after strip, optionally casefolded)."""
    want = _need(answer, "answer", "exact")

    def norm(s: str) -> str:
        s = s.strip() if strip else s
        return s if case_sensitive else s.casefold()

    return [1.0 if norm(c) == norm(want) else 0.0 for c in completions]


_FLAGS = {"i": re.IGNORECASE, "s": re.DOTALL, "m": re.MULTILINE, "x": re.VERBOSE}


@lru_cache(maxsize=256)
def _compile(pattern: str, flags: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, sum(_FLAGS[f] for f in flags))
    except KeyError as e:
        raise VerifierError(f"regex flags must be among {sorted(_FLAGS)}, got {flags!r}") from e
    except re.error as e:
        raise VerifierError(f"regex pattern {pattern!r} does not compile: {e}") from e


@register_verifier("regex")
def regex(
    completions: Sequence[str],
    pattern: str | None = None,
    mode: str = "search",
    flags: str = "",
    **_: object,
) -> list[float]:
    """1.0 when `pattern` matches (mode "search" anywhere, "fullmatch" the whole completion)."""
    rx = _compile(_need(pattern, "pattern", "regex"), flags)
    if mode not in ("search", "fullmatch", "match"):
        raise VerifierError(f"regex mode must be search, match or fullmatch, got {mode!r}")
    test = getattr(rx, mode)
    return [1.0 if test(c) else 0.0 for c in completions]


# A common reasoning format: <think>...</think> then an answer; a format verifier is a regex.
THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


@register_verifier("format")
def format_check(completions: Sequence[str], pattern: str = THINK_ANSWER, flags: str = "s", **_: object) -> list[float]:
    """1.0 when the whole completion has the expected shape (default: <think>..</think><answer>..</answer>)."""
    return regex(completions, pattern=pattern, mode="fullmatch", flags=flags)


@register_verifier("overlong")
def overlong(
    completions: Sequence[str],
    completion_tokens: Sequence[int] | None = None,
    max_tokens: int | None = None,
    max_len: int = 0,
    cache: int = 0,
    **_: object,
) -> list[float]:
    """DAPO's soft overlong punishment, in [-1, 0]; add it with weight 1 to the task's reward.

    With L = max_len (default: the job's max_tokens) and a buffer C = cache (default L/4):
    0 up to L - C tokens, then linearly down to -1 at L, and -1 beyond.
    """
    if completion_tokens is None:
        raise VerifierError("overlong needs completion_tokens (the reward service passes them)")
    limit = int(max_len or max_tokens or 0)
    if limit <= 0:
        raise VerifierError("overlong needs max_len or the job's max_tokens")
    buf = int(cache) if cache else max(1, limit // 4)
    if not 0 < buf <= limit:
        raise VerifierError(f"overlong cache must be in (0, max_len={limit}], got {buf}")
    out: list[float] = []
    for n in completion_tokens:
        if n <= limit - buf:
            out.append(0.0)
        elif n <= limit:
            out.append(Scored(((limit - buf) - n) / buf, "overlong"))
        else:
            out.append(Scored(-1.0, "overlong"))
    return out
