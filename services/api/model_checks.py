"""A job against its base model's files, at submission: the prompt format its tokenizer allows,
and prompts that fit the context (services/api/checks.py turns a problem into a 422).

Read without torch (shared/model_files.py), tokens counted with `tokenizers` (Rust, no torch)
from the folder's tokenizer.json. Only a base model that is a local folder on the api's box
can be read; for a hub id nothing is checked here, and rollout refuses what does not fit
(a prompt past the context is dead-lettered with the engine's reason).

The prompts checked are a sample: the first train items of the job's seed and the first
held-out ones. A chat prompt is counted without its template's own tokens, so the count is
a lower bound: a job refused here could never run, one accepted may still have a few prompts
that do not fit.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.domain.tasks import Task
from shared.job import JobSpec
from shared.model_files import context_length, has_chat_template, local_folder, raw_prompt_model, resolve_prompt_format

PROMPTS_CHECKED = 16  # train items and held-out items each

Problem = tuple[tuple[str | int, ...], str]  # (the field's path in the body, what to fix)


def prompt_format_problem(spec: JobSpec) -> Problem | None:
    """prompt_format 'chat' for a base model whose tokenizer has no chat template."""
    folder = local_folder(spec.base_model)
    if spec.prompt_format != "chat" or folder is None or has_chat_template(folder):
        return None
    return (
        ("prompt_format",),
        f"prompt_format = 'chat', but the base model {spec.base_model} has no chat template (no chat_template.jinja, "
        "and none in tokenizer_config.json): use prompt_format 'raw', or a model whose tokenizer has one",
    )


def prompt_length_problem(spec: JobSpec, task: Task, rollout_contexts: list[int]) -> Problem | None:
    """The longest sampled prompt plus sampling.max_tokens past the context: the rollout replicas'
    (the largest advertised), else the model's own (config.json)."""
    folder = local_folder(spec.base_model)
    if folder is None or not (folder / "tokenizer.json").is_file():
        return None
    context = max(rollout_contexts) if rollout_contexts else context_length(folder)
    if not context:
        return None
    chat = (
        resolve_prompt_format(
            spec.prompt_format,
            chat_template=has_chat_template(folder),
            raw_model=raw_prompt_model(folder),
            multi_turn=bool(spec.env.name),
        )
        == "chat"
    )
    items = list(itertools.islice(task.train_items(spec.seed), PROMPTS_CHECKED))
    if spec.eval_size:
        items += task.heldout_items(min(spec.eval_size, PROMPTS_CHECKED))
    if not items:
        return None
    tok = _tokenizer(str(folder / "tokenizer.json"), (folder / "tokenizer.json").stat().st_mtime_ns)
    # A raw prompt gets the special tokens the engine adds to text; a chat one is counted alone
    # (its template adds tokens on top: a lower bound).
    longest, item = max((len(tok.encode(it.prompt, add_special_tokens=not chat).ids), it.item_id) for it in items)
    need = longest + spec.sampling.max_tokens
    if need <= context:
        return None
    where = "rollout replicas' context (max_model_len)" if rollout_contexts else "model's context (config.json)"
    if longest >= context:
        loc: tuple[str | int, ...] = _prompt_source(spec)
        fix = "shorten the prompts (a smaller task configuration or template)"
    else:
        loc = ("sampling", "max_tokens")
        fix = f"lower sampling.max_tokens to at most {context - longest}"
    fmt = "chat" if chat else "raw"
    return (
        loc,
        f"prompt {item} is {longest} tokens ({fmt}{', before its chat template' if chat else ''}); with "
        f"sampling.max_tokens={spec.sampling.max_tokens} it needs {need}, past the {where} of {context}: {fix}",
    )


def _prompt_source(spec: JobSpec) -> tuple[str, ...]:
    ts = spec.task_spec
    if ts.source is not None:
        return ("task_spec", "source", "path")
    return ("task_spec", "template") if ts.template else ("task",)


@lru_cache(maxsize=4)
def _tokenizer(path: str, mtime_ns: int) -> Any:  # noqa: ARG001 (mtime_ns: a changed file is read again)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path)))
