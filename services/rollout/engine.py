"""The generation engine behind one small interface. In-process vLLM for now.

vLLM is imported lazily (inside the class) so `--help` and the light tests never pay
for it. Each policy version is a NEW LoRA name, id and folder: vLLM serves stale
weights or stale prefix-cache blocks if a name or path is reused.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapter:
    name: str
    lora_id: int
    path: str


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class Generation:
    prompt_ids: list[int]
    samples: list[Sample]


class InProcessEngine:
    def __init__(
        self, *, model: str, max_model_len: int, max_lora_rank: int, max_loras: int, dtype: str, seed: int
    ) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU backend's default is 4
        from vllm import LLM

        self.model = model
        self.llm = LLM(
            model=model,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            # Log-probs of the distribution actually sampled from (after temperature
            # and top-p); the default raw mode reports temperature-1 values.
            logprobs_mode="processed_logprobs",
        )
        self._ids = itertools.count(1)

    def new_adapter(self, name: str, path: str) -> Adapter:
        return Adapter(name=name, lora_id=next(self._ids), path=path)

    def unload(self, adapter: Adapter) -> None:
        try:
            self.llm.llm_engine.remove_lora(adapter.lora_id)
        except Exception as e:  # not loaded yet (never used) is fine
            log.debug("remove_lora(%s): %s", adapter.name, e)

    def generate(
        self,
        prompts: list[str],
        adapters: list[Adapter | None],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
    ) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        # logprobs=0: just the sampled token's log-prob (of the processed distribution,
        # see the engine's logprobs_mode above).
        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0 if temperature > 0 else None
        )
        loras = [LoRARequest(a.name, a.lora_id, a.path) if a else None for a in adapters]
        outs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        result = []
        for o in outs:
            samples = []
            for c in o.outputs:
                # vLLM always includes the sampled token in each position's dict; greedy
                # evaluation asks for no log-probs at all (zeros are never trained on).
                if c.logprobs:
                    lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
                else:
                    lps = [0.0] * len(c.token_ids)
                samples.append(Sample(list(c.token_ids), lps, c.text, c.finish_reason or "stop"))
            result.append(Generation(list(o.prompt_token_ids or []), samples))
        return result
