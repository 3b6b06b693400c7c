"""Text verifiers: exact match, regex/format checks, DAPO's overlong length shaping.

Patterns come from jobs (args or dataset fields), so they run on RE2 (google-re2), whose
matching time is linear in the text: Python's backtracking `re` took 1.7 s on 24
characters of `(a+)+$`, doubling per character (issue 18, item 15). RE2 has no
backreferences or lookaround; a pattern using them is refused at submission.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import re2

from shared.domain.verifiers.registry import Scored, VerifierError


def _need(value: object, name: str, verifier: str) -> str:
    if value is None:
        raise VerifierError(f"verifier {verifier!r} needs a task field or arg {name!r}")
    return str(value)


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


# i: ignore case, s: `.` matches newlines, m: ^ and $ match at line ends (RE2's inline flags).
# Python's x (verbose) has no RE2 form.
FLAGS = ("i", "m", "s")
MODES = ("search", "match", "fullmatch")


def _options() -> re2.Options:
    opts = re2.Options()
    opts.log_errors = False  # a refused pattern is the caller's error, not a line on stderr
    return opts


_OPTIONS = _options()


@lru_cache(maxsize=256)
def compile_pattern(pattern: str, flags: str = "") -> Any:
    """A job-supplied pattern compiled by RE2 (linear-time matching); VerifierError says why not."""
    if not isinstance(flags, str) or set(flags) - set(FLAGS):
        raise VerifierError(
            f"regex flags must be letters among {list(FLAGS)} (RE2 has no x), got {flags!r}", arg="flags"
        )
    prefix = f"(?{''.join(sorted(set(flags)))})" if flags else ""
    try:
        return re2.compile(prefix + pattern, _OPTIONS)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        shown = pattern if len(pattern) <= 100 else pattern[:100] + "..."
        raise VerifierError(
            f"regex pattern {shown!r} does not compile under RE2 ({why}); RE2 matches in linear time and has no "
            "backreferences or lookaround",
            arg="pattern",
        ) from None


def regex(
    completions: Sequence[str],
    pattern: str | None = None,
    mode: str = "search",
    flags: str = "",
    **_: object,
) -> list[float]:
    """1.0 when `pattern` matches (mode "search" anywhere, "fullmatch" the whole completion)."""
    rx = compile_pattern(_need(pattern, "pattern", "regex"), flags)
    if mode not in MODES:
        raise VerifierError(f"regex mode must be one of {list(MODES)}, got {mode!r}", arg="mode")
    test = getattr(rx, mode)
    return [1.0 if test(c) else 0.0 for c in completions]


def check_pattern_args(args: Mapping[str, Any]) -> None:
    if "mode" in args and args["mode"] not in MODES:
        raise VerifierError(f"regex mode must be one of {list(MODES)}, got {args['mode']!r}", arg="mode")
    if isinstance(args.get("pattern"), str):  # else it comes from the item's fields
        compile_pattern(args["pattern"], args.get("flags", ""))
    elif "flags" in args:
        compile_pattern("", args["flags"])


# A common reasoning format: <think>...</think> then an answer; a format verifier is a regex.
THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def format_check(completions: Sequence[str], pattern: str = THINK_ANSWER, flags: str = "s", **_: object) -> list[float]:
    """1.0 when the whole completion has the expected shape (default: <think>..</think><answer>..</answer>)."""
    return regex(completions, pattern=pattern, mode="fullmatch", flags=flags)


def check_overlong_args(args: Mapping[str, Any]) -> None:
    for key in ("max_len", "cache"):
        if key in args and (not isinstance(args[key], int) or isinstance(args[key], bool) or args[key] < 0):
            raise VerifierError(
                f"overlong {key} must be a whole number >= 0 (0: the default), got {args[key]!r}", arg=key
            )


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
