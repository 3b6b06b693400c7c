"""Math-answer equivalence with Hugging Face's `math-verify` (boxed answers, fractions, LaTeX)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from shared.domain.verifiers.registry import Scored, VerifierError


def _timeouts() -> dict[str, Any]:
    # math-verify's timeouts use signal.alarm, which only works in the main thread; in a
    # thread, turn them off (the reward service runs verifiers in worker processes'
    # main threads, so its timeouts stay on there).
    if threading.current_thread() is threading.main_thread():
        return {}
    return {"parsing_timeout": None}


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list[Any]:
    from math_verify import parse

    kw = _timeouts()
    # A bare gold answer ("\\frac12", "x^2+1") parses only inside an anchor.
    if "\\boxed" in answer or "$" in answer:
        gold = parse(answer, **kw)
    else:
        gold = parse(f"\\boxed{{{answer}}}", **kw) or parse(answer, **kw)
    return gold


def math_equiv(completions: Sequence[str], answer: str | None = None, **_: object) -> list[float]:
    """1.0 when the completion's final answer (\\boxed{} first, else the last expression)
    is mathematically equal to `answer`: 1/2 = 0.5 = \\frac{2}{4}, {1,2} = {2,1}, ..."""
    if answer is None:
        raise VerifierError("verifier 'math' needs a task field 'answer'")
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise VerifierError("verifier 'math' needs the math-verify package: pip install 'math-verify>=0.8'") from e
    gold = _parse_gold(str(answer))
    if not gold:
        raise VerifierError(f"the gold answer {answer!r} does not parse as math; fix the dataset's answer field")
    kw = _timeouts()
    vkw = {"timeout_seconds": None} if kw else {}
    out: list[float] = []
    for c in completions:
        pred = parse(c, **kw)
        if not pred:
            out.append(Scored(0.0, "no_answer"))
        else:
            out.append(1.0 if verify(gold, pred, **vkw) else 0.0)
    return out
