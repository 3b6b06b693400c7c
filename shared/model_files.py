"""What a local model folder's files say, read without torch: its context length, whether its
tokenizer has a chat template, and how a job's prompts are formatted for it (`JobSpec.prompt_format`).

The api checks a job against its base model with these (services/api/model_checks.py), and
rollout decides with `resolve_prompt_format` whether a job's prompts go through the chat
template (services/rollout/prompts.py): one rule for both. A hub id is not read here (nothing
is downloaded at run time); callers then know less and say so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

PromptFormat = Literal["auto", "chat", "raw"]
# The tiny models' marks: shared/ml/tiny_model.py writes the first (kind "tiny") into a random-init
# model, shared/ml/models.py the second into each one it SFTs on raw prompts. An imported GGUF's
# folder has the first too, of kind "gguf" (shared/ml/gguf_import.py).
MODEL_NOTE = "burstrl_model.json"
TINY_BUILT = "burstrl_ready.json"
# config.json keys that hold the context length, by architecture family.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


def local_folder(model: str) -> Path | None:
    """`model` as a local folder, or None (a hub id, or a path that is not a folder here)."""
    p = Path(model).expanduser()
    return p if p.is_dir() else None


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def has_chat_template(folder: Path) -> bool:
    """Whether the folder's tokenizer has a chat template (the file transformers >= 4.47 writes,
    the older chat_template.json, or the key in tokenizer_config.json)."""
    if (folder / "chat_template.jinja").is_file():
        return True
    if _json(folder / "chat_template.json").get("chat_template"):
        return True
    return bool(_json(folder / "tokenizer_config.json").get("chat_template"))


def context_length(folder: Path) -> int | None:
    """The model's context length from config.json (None when it says none)."""
    cfg = _json(folder / "config.json")
    for c in (cfg, cfg.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            v = c.get(key) if isinstance(c, dict) else None
            if isinstance(v, int) and v > 0:
                return v
    return None


def raw_prompt_model(folder: Path | None) -> bool:
    """A model known to be trained on raw prompts: the tiny models this repo builds. Their
    tokenizer carries a chat template for the agent endpoint (docs/agents.md), but their SFT
    data is raw text ("12+34="), so their jobs' prompts stay raw unless a job asks for chat."""
    if folder is None:
        return False
    return (folder / TINY_BUILT).is_file() or _json(folder / MODEL_NOTE).get("kind") == "tiny"


def resolve_prompt_format(
    requested: PromptFormat, *, chat_template: bool, raw_model: bool = False, multi_turn: bool = False
) -> Literal["chat", "raw"]:
    """How a job's prompts reach the model. "chat"/"raw" as asked; "auto": chat when the
    tokenizer has a chat template, unless the model is trained on raw prompts (`raw_prompt_model`).
    Multi-turn environments build their own token context from raw text (services/rollout/episodes.py)."""
    if requested != "auto":
        return requested
    if multi_turn or raw_model or not chat_template:
        return "raw"
    return "chat"
