"""`RemoteEngine`: a client of a remote OpenAI-compatible vLLM server, behind the `Engine`
interface (engine.py).

Uses only endpoints vLLM 0.11 already had (`/v1/completions` with `logprobs`,
`prompt_logprobs`, `return_tokens_as_token_ids`; `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `/tokenize`, `/health`); newer fields (`return_token_ids`) are
used when the server returns them, else derived. The server must run with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, `--enable-lora` and `--logprobs-mode processed_logprobs`
(the client cannot set that per request). Its base weights are fixed when it starts:
`load_full` refuses.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

from services.rollout.engine import Adapter, Generation, Prompt, Sample, SamplingConfig, checked_logprobs
from services.rollout.errors import LORA_HELP, AdapterError, EngineRequestRefused, EngineUnavailable, RequestFailed
from shared.engines.openai_client import OpenAIClient

log = logging.getLogger(__name__)


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
