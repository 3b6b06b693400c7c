"""The generation engine: one small interface (`Engine`), two modes, and the factory that
picks one from the rollout settings.

- `InProcessEngine` (engine_inprocess.py): vLLM's `LLM` in this process (the laptop/CI default,
  and NVIDIA boxes).
- `RemoteEngine` (engine_remote.py): a client of an OpenAI-compatible vLLM server, e.g. the
  gfx906 fork's container on an MI50 box.

Each policy version is a NEW LoRA name, id and folder: vLLM serves stale weights or stale
prefix-cache blocks if a name or path is reused (so no `load_inplace`, which 0.11 lacks
anyway). vLLM is imported lazily so `--help` and the light tests never pay for it.

Full-weight versions replace the engine's base weights (`load_full`): in-process only; a
remote server's base weights are fixed when it starts (`full_weights` is False there).

Errors: services/rollout/errors.py. Both engines run one set of contract tests
(tests/integration/test_rollout_engines.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.rollout.errors import EngineUnavailable, MissingLogprob

if TYPE_CHECKING:
    from services.rollout.settings import RolloutSettings


Prompt = str | list[int]  # text for the engine to tokenize, or token ids used as they are


@dataclass(frozen=True)
class Adapter:
    name: str
    lora_id: int
    path: str  # as the engine sees it (the remote server may mount the cache elsewhere)


@dataclass(frozen=True)
class SamplingConfig:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...] = ()
    # Keep a stop string in the text (multi-turn: a tool call's closing tag is part of what
    # the model produced, and the token ids hold it anyway).
    include_stop: bool = False
    # What a Tinker sample call may add (services/rollout/tinker_sampling.py): stop token ids,
    # top-k (-1: off) and a per-request seed.
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = -1
    seed: int | None = None


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (hit max_tokens: truncated)


@dataclass
class Generation:
    prompt_ids: list[int]
    samples: list[Sample] = field(default_factory=list)


def checked_logprobs(values: Sequence[float | None], n_tokens: int, what: str, index: int | None) -> list[float]:
    """The engine's log-probs of n tokens, each present and finite; MissingLogprob otherwise.

    Both engines refuse to make one up: a 0.0 stands for "probability 1" and would bias the
    importance weights the trainer computes from these values (docs/architecture.md, invariant 6)."""
    if len(values) != n_tokens:
        raise MissingLogprob(f"{what}: the engine returned {len(values)} log-probs for {n_tokens} tokens", index)
    out = []
    for i, x in enumerate(values):
        if x is None or not math.isfinite(x):
            raise MissingLogprob(f"{what}: the engine returned log-prob {x} for token {i}", index)
        out.append(float(x))
    return out


class Engine(Protocol):
    mode: str
    dtype: str  # what the engine computes in ("float32", "bfloat16", ...; "unknown" when remote)

    def load_adapter(self, name: str, path: str) -> Adapter:
        """Load a LoRA folder under a new name now, so errors surface at adoption, not mid-batch."""
        ...

    def unload(self, adapter: Adapter) -> None: ...

    # Whether `load_full` can work at all (False: every full-weight version is refused).
    full_weights: bool

    def load_full(self, path: str | None) -> None:
        """Serve the full weights of model folder `path` as the base model (None: the model the
        engine started with). No request may be in flight. Raises AdapterError when the folder
        is refused (the previous weights keep serving) and EngineUnavailable when the engine is lost.
        Every loaded adapter is gone afterwards."""
        ...

    def generate(self, prompts: list[Prompt], adapters: list[Adapter | None], cfg: SamplingConfig) -> list[Generation]:
        """Samples for each prompt (text, which the engine tokenizes with its special tokens, or
        token ids used as they are), with every sampled token's log-prob. Raises RequestFailed
        (its `index`: the prompt) when one request is refused or answered without a log-prob."""
        ...

    def generate_ids(
        self, prompts: list[list[int]], adapters: list[Adapter | None], cfg: SamplingConfig
    ) -> list[Generation]:
        """As `generate`, from token ids as they are: multi-turn episodes never re-tokenize
        their context, so the model sees exactly the ids the trainer will train on."""
        ...

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        """Token ids of `text`; special=True adds what a text prompt gets (e.g. BOS)."""
        ...

    def has_chat_template(self) -> bool:
        """Whether the served model's tokenizer has a chat template."""
        ...

    def chat_ids(self, text: str) -> list[int]:
        """Token ids of `text` as one user message through the model's chat template, with the
        generation prompt, tokenized without adding special tokens (the template writes its own:
        adding a BOS again would give the model a prompt it never saw). EngineRequestRefused when
        the model has no chat template."""
        ...

    def prompt_logprobs(self, token_ids: list[int], adapter: Adapter | None) -> list[float]:
        """log p(t_i | t_<i) for i >= 1 at temperature 1 (the probe); RequestFailed as `generate`."""
        ...

    def check(self) -> None:
        """Raise EngineUnavailable when the engine cannot serve."""
        ...

    def close(self) -> None: ...


def build_engine(s: RolloutSettings) -> Engine:
    """The configured engine; raises EngineUnavailable when it cannot be built or reached."""
    if s.engine == "remote":
        from services.rollout.engine_remote import RemoteEngine

        if not s.engine_url:
            raise EngineUnavailable("BURSTRL_ROLLOUT_ENGINE=remote needs BURSTRL_ROLLOUT_ENGINE_URL")
        local, sep, remote = s.engine_path_map.partition("=")
        return RemoteEngine(
            url=s.engine_url,
            api_key=s.engine_api_key.get_secret_value(),
            served_model=s.engine_served_model,
            timeout_s=s.engine_timeout_s,
            concurrency=s.engine_concurrency,
            path_map=(local, remote) if sep else None,
        )
    from services.rollout.engine_inprocess import InProcessEngine

    return InProcessEngine(
        model=s.model,
        max_model_len=s.max_model_len,
        max_lora_rank=s.max_lora_rank,
        max_loras=s.max_loras,
        dtype=s.dtype,
        seed=s.seed,
        **s.engine_kwargs(),
    )


def engine_context(s: RolloutSettings, engine: Engine) -> int:
    """The engine's context length: the setting in-process; a remote server's if it says (vLLM's
    /v1/models lists max_model_len), else 0 (unknown: the api accepts and warns)."""
    if s.engine != "remote":
        return s.max_model_len
    try:
        cards = engine.base_models()  # type: ignore[attr-defined]
        served = [m for m in cards if m.get("id") == getattr(engine, "served_model", None)] or cards
        return max((int(m.get("max_model_len") or 0) for m in served), default=0)
    except Exception:  # noqa: BLE001 - an older server or an odd reply: unknown, not fatal
        return 0
