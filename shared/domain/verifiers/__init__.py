"""Verifiers: plain functions `(completions, **task_fields) -> rewards`, registered by name.

Built in: exact, regex, format, overlong (DAPO length shaping), math (math-verify),
code (sandboxed tests), http (a JSON reward-model endpoint), openai_judge (an
OpenAI-compatible server as a judge), registered in shared/domain/catalog.py. Weighted
combinations: `score_components`.
Pure Python: no torch or vllm (shared/ stays light); math-verify is imported lazily.
"""

from __future__ import annotations

from shared.domain.verifiers.combine import TAG_SEP, TagBudget, error_tag, score_components, split_parts
from shared.domain.verifiers.registry import (
    Scored,
    VerifierError,
    VerifierFn,
    check_verifier_args,
    get_verifier,
    load_plugins,
    register_arg_check,
    register_verifier,
    verifier_names,
)

__all__ = [
    "TAG_SEP",
    "TagBudget",
    "Scored",
    "VerifierError",
    "VerifierFn",
    "check_verifier_args",
    "error_tag",
    "get_verifier",
    "load_plugins",
    "register_arg_check",
    "register_verifier",
    "score_components",
    "split_parts",
    "verifier_names",
]
