"""A job's prompt text -> what the engine is given (`JobSpec.prompt_format`): the one place the
chat template is applied to a task's prompts.

Why in rollout: the chat template belongs to the tokenizer, and rollout is the one stage that
holds the served model's tokenizer (in-process) or can ask the server that holds it (remote,
`/tokenize` with messages). It renders the prompt to token ids, the engine samples from those
ids, and the group carries them (`GroupMsg.prompt_ids`): ref scores and the trainer trains on
exactly the ids the sampler saw, so nothing downstream renders or tokenizes a prompt again. The
api stays torch-free and the feeder's prompts stay the task's own text, which the reward
service's verifiers read.

A chat prompt is rendered to ids without adding special tokens (the template writes them); a
raw prompt stays text, tokenized by the engine with the special tokens a text prompt gets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from services.rollout.errors import RequestFailed
from shared.model_files import local_folder, raw_prompt_model, resolve_prompt_format

if TYPE_CHECKING:
    from services.rollout.engine import Engine, Prompt
    from shared.job import JobSpec


class PromptRenderer:
    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        # The model folder rollout serves, read once: a tiny model trained on raw prompts stays raw.
        self.raw_model = raw_prompt_model(local_folder(model)) if model else False

    def format_of(self, spec: JobSpec) -> Literal["chat", "raw"]:
        if spec.prompt_format == "raw" or spec.env.name:  # no need to ask the engine
            return "raw"
        return resolve_prompt_format(
            spec.prompt_format,
            chat_template=self.engine.has_chat_template(),
            raw_model=self.raw_model,
            multi_turn=bool(spec.env.name),
        )

    def render(self, batch: list[tuple[str, JobSpec]]) -> list[Prompt]:
        """Each (prompt text, job) as the engine's input; a prompt that cannot be rendered raises
        RequestFailed with its index (the caller isolates it, as it does an engine refusal)."""
        out: list[Prompt] = []
        for i, (text, spec) in enumerate(batch):
            if self.format_of(spec) == "raw":
                out.append(text)
                continue
            try:
                out.append(self.engine.chat_ids(text))
            except RequestFailed as e:
                e.index = i
                raise
        return out
