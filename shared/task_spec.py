"""A job's task configuration (`JobSpec.task_spec`): prompt source, template, verifiers.

The defaults keep a job exactly as before: prompts, template and verifier all come
from the registered task named by `JobSpec.task` (e.g. "arith").
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Self

from pydantic import Field, model_validator

from shared.limits import (
    ARGS_MAX_KEYS,
    FIELDS_MAX,
    PATH_MAX,
    TEMPLATE_MAX,
    VERIFIERS_MAX,
    ArgKey,
    ArgList,
    ArgScalar,
    Column,
    Name,
    Shown,
    SpecModel,
)

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


class VerifierRef(SpecModel):
    """One component of the reward: a registered verifier, its weight and arguments."""

    name: Name = Field(..., min_length=1, description="Registered verifier name (exact, math, code, regex, ...).")
    weight: float = Field(1.0, ge=-100.0, le=100.0, description="Its reward is multiplied by this.")
    part: str = Field(
        "", max_length=48, pattern=r"^[A-Za-z0-9_.-]{0,48}$", description="Name in reward_parts; default: name."
    )
    args: dict[ArgKey, ArgScalar | ArgList] = Field(
        default_factory=dict,
        max_length=ARGS_MAX_KEYS,
        description="Keyword arguments for the verifier (e.g. pattern for regex); checked against the verifier's "
        "own at submission.",
    )


class SourceSpec(SpecModel):
    """Prompts from local files or the local Hugging Face cache (never downloaded at run time)."""

    kind: Literal["jsonl", "parquet", "hf"] = Field(..., description="File format, or a `datasets` dataset.")
    path: Annotated[str, Shown] = Field(
        ...,
        min_length=1,
        max_length=PATH_MAX,
        description="jsonl/parquet: a file path. hf: a save_to_disk folder, a data file, or a dataset name "
        "already in the local cache.",
    )
    config: Column = Field("", description="hf: dataset config name.")
    split: Column = Field("train", description="hf: the split prompts come from.")
    heldout_split: Column = Field("", description="hf: a split used as held-out; empty: a hash split of `split`.")
    heldout_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of rows held out by hash.")
    prompt_field: Column = Field("prompt", min_length=1, description="Column holding the prompt text.")
    id_field: Column = Field("", description="Column holding a stable row id; empty: a hash of the prompt.")
    fields: list[Column] = Field(
        default_factory=lambda: ["answer"],
        max_length=FIELDS_MAX,
        description="Columns passed to verifiers (non-strings as JSON).",
    )


class TaskSpec(SpecModel):
    """How a job gets prompts and rewards. Empty = the registered task's own behaviour."""

    source: SourceSpec | None = Field(None, description="Prompt source; empty: the task named by `task`.")
    template: str = Field(
        "",
        max_length=TEMPLATE_MAX,
        description="Prompt template with {prompt} and {field} placeholders ({{ }} for braces); empty: as is.",
    )
    verifiers: list[VerifierRef] = Field(
        default_factory=list, max_length=VERIFIERS_MAX, description="Weighted reward components; empty: the task's own."
    )
    timeout_s: float = Field(60.0, gt=0.0, le=3600.0, description="Deadline to score one group.")
    args: dict[ArgKey, ArgScalar | ArgList] = Field(
        default_factory=dict,
        max_length=ARGS_MAX_KEYS,
        description="Options of a task family, e.g. for task 'rg:<dataset>' the reasoning-gym dataset's config "
        "fields (min_terms, max_digits, ...) plus answer_format ('tag' or 'raw') and heldout_fraction.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.source is not None and not self.verifiers:
            raise ValueError("task_spec.source needs task_spec.verifiers, e.g. [{name = 'math'}]")
        parts = [v.part or v.name for v in self.verifiers]
        if len(set(parts)) != len(parts):
            raise ValueError(f"task_spec.verifiers parts must be distinct (set `part`), got {parts}")
        if self.source is not None and self.args:
            raise ValueError("task_spec.args are a task family's options; a task_spec.source task has none")
        if self.template:
            render_template(self.template, {"prompt": ""}, check_only=True)
        return self


def render_template(template: str, values: dict[str, str], *, check_only: bool = False) -> str:
    """Substitute {name} placeholders; no attribute or index access (a template is user input)."""

    def sub(m: re.Match[str]) -> str:
        tok = m.group(0)
        if tok in ("{{", "}}"):
            return tok[0]
        if check_only:
            return ""
        name = m.group(1)
        if name not in values:
            raise KeyError(f"template placeholder {{{name}}} is not a field of this item ({sorted(values)})")
        return values[name]

    if not check_only:
        return _PLACEHOLDER.sub(sub, template)
    stripped = _PLACEHOLDER.sub(sub, template)
    if "{" in stripped or "}" in stripped:
        raise ValueError("template braces must be {name} placeholders or doubled {{ }}")
    return ""
