"""Scoring engines: per-token log-probs of given (prompt, completion) token sequences.

- `HFScorer`: transformers, the same forward pass and fp32 log-softmax the trainer uses, so
  its numbers are the trainer's own (bit-for-bit on CPU fp32 up to batch shape).
- `VllmScorer`: vLLM in this process, `prompt_logprobs=0` on token-id prompts.
- `RemoteScorer`: an OpenAI-compatible vLLM server's `/v1/completions` with token-id
  prompts and `prompt_logprobs` (vLLM >= 0.4, so the gfx906 fork's 0.11 has it); a server
  that ignores the field is asked again with `echo` + `logprobs`, the older OpenAI way.

All return, for each (prompt, completion), log p(completion[j] | prompt + completion[:j]) at
temperature 1. Errors: `Rejected` means "this input cannot be scored here" (too long, token
ids outside the vocabulary): the caller rejects the group; `ScorerUnavailable` means "the engine is
away": the caller retries later. vLLM is imported lazily so the light paths never pay for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from shared.engines.openai_client import OpenAIClient
from shared.engines.vllm_setup import engine_dead, prepare_cpu_engine_env, shut_down, warm_up

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Seq = tuple[list[int], list[int]]  # (prompt token ids, completion token ids)


RejectKind = Literal["too_long", "input", "engine_refused"]


class Rejected(ValueError):
    """This input cannot be scored by this engine (permanent): reject the group, keep serving.

    `kind` labels the dead-letter metric: too_long (past the reference's context), input (an
    id outside its vocabulary, an empty prompt), engine_refused (the engine's own validation).
    """

    def __init__(self, kind: RejectKind, message: str) -> None:
        super().__init__(message)
        self.kind: RejectKind = kind


class ScorerUnavailable(RuntimeError):
    """The engine cannot serve right now (not started, unreachable, died): retry later."""


class RefScorer(Protocol):
    mode: str
    model: str
    dtype: str
    max_len: int  # longest prompt + completion the engine accepts, in tokens
    vocab_size: int  # token ids must be below this; 0 when unknown (remote)

    def score(self, seqs: list[Seq]) -> list[list[float]]:
        """Log-prob of each completion token; raises Rejected or ScorerUnavailable."""
        ...

    def check(self) -> None:
        """Raise ScorerUnavailable when the engine cannot serve."""
        ...

    def close(self) -> None: ...


def validate(seq: Seq, max_len: int, vocab_size: int) -> None:
    """Raise Rejected, naming the problem, for a sequence no engine could score."""
    prompt, completion = seq
    if not prompt:
        raise Rejected("input", "empty prompt: the first completion token has no context to be scored in")
    n = len(prompt) + len(completion)
    if n > max_len:
        raise Rejected("too_long", f"sequence of {n} tokens exceeds the reference's context of {max_len}")
    if vocab_size:
        bad = [t for t in (*prompt, *completion) if t < 0 or t >= vocab_size]
        if bad:
            raise Rejected("input", f"token id {bad[0]} is outside the reference's vocabulary of {vocab_size}")


def right_padded(seqs: list[Seq], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` of `seqs` as one right-padded batch: prompt + completion ids (0 after the end) and
    the attention mask (1 up to each row's end)."""
    import torch

    length = max(len(seqs[i][0]) + len(seqs[i][1]) for i in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, i in enumerate(rows):
        p, c = seqs[i]
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        attn[r, : len(p) + len(c)] = 1
    return ids, attn


class HFScorer:
    """transformers forward pass, right-padded batches of at most `max_batch_tokens` padded tokens."""

    mode = "hf"

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "auto",
        max_batch_tokens: int | None = None,
        logits_chunk: int = 0,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from shared.ml.chunked_logprobs import check_model, resolve_logits_chunk
        from shared.ml.pass_tokens import ref_pass_tokens

        # The trainer's choice (services/trainer/policy.py): bf16 on GPUs, fp32 on CPU.
        if dtype == "auto":
            tdtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        else:
            tdtype = getattr(torch, dtype)
        self.model = model
        self.device = device
        self.dtype = str(tdtype).removeprefix("torch.")
        self.net = AutoModelForCausalLM.from_pretrained(model, dtype=tdtype).to(device).eval()
        cfg = self.net.config
        self.max_len = int(getattr(cfg, "max_position_embeddings", None) or 1 << 30)
        self.vocab_size = int(self.net.get_input_embeddings().weight.shape[0])
        # Log-probs from the head a chunk of tokens at a time (shared/ml/chunked_logprobs.py), so a
        # pass never holds fp32 [tokens, vocab] logits; a model it cannot run is refused here.
        check_model(self.net)
        self.logits_chunk = resolve_logits_chunk(logits_chunk, int(self.net.get_output_embeddings().weight.shape[0]))
        self.max_batch_tokens = ref_pass_tokens(cfg, setting=max_batch_tokens, logits_chunk=logits_chunk)
        if max_batch_tokens is None:
            log.info("max_batch_tokens unset: %d from %s's shape", self.max_batch_tokens, model)

    def score(self, seqs: list[Seq]) -> list[list[float]]:

        for s in seqs:
            validate(s, self.max_len, self.vocab_size)
        out: list[list[float]] = [[] for _ in seqs]
        # Shortest first, so each chunk pads to about its own length.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
        chunk: list[int] = []
        for i in order:
            length = len(seqs[i][0]) + len(seqs[i][1])
            if chunk and (len(chunk) + 1) * length > self.max_batch_tokens:
                self._run(seqs, chunk, out)
                chunk = []
            chunk.append(i)
        if chunk:
            self._run(seqs, chunk, out)
        return out

    def _run(self, seqs: list[Seq], rows: list[int], out: list[list[float]]) -> None:
        import torch

        from shared.ml.chunked_logprobs import chunked_token_logprobs, head_params, model_hidden

        ids, attn = right_padded(seqs, rows)
        # Only completion tokens are scored: position j predicts token j + 1, so row r's
        # completion is predicted by positions len(p)-1 .. len(p)+len(c)-2.
        row_idx = torch.cat([torch.full((len(seqs[i][1]),), r) for r, i in enumerate(rows)])
        pos_idx = torch.cat([torch.arange(len(seqs[i][1])) + len(seqs[i][0]) - 1 for i in rows])
        with torch.no_grad():
            # The trainer's computation (learner.Learner._forward): the right-padded batch's final
            # hidden states, the head's logits chunk by chunk, log-softmax in fp32.
            hidden = model_hidden(self.net, ids.to(self.device), attn.to(self.device))
            weight, bias = head_params(self.net)
            sel = hidden[row_idx.to(self.device), pos_idx.to(self.device)]  # [completion tokens, H]
            targets = ids[row_idx, pos_idx + 1].to(self.device)
            lp = chunked_token_logprobs(sel, weight, targets, chunk=self.logits_chunk, bias=bias).cpu()
        at = 0
        for i in rows:
            n = len(seqs[i][1])
            out[i] = lp[at : at + n].tolist()
            at += n

    def check(self) -> None:
        return None

    def close(self) -> None:
        return None


def _from_prompt_logprobs(plp: list, seq: Seq, key: Callable[[int], object]) -> list[float]:
    """Completion log-probs from a prompt-logprobs list over prompt + completion (entry 0 is None)."""
    prompt, completion = seq
    out = []
    for j, t in enumerate(completion):
        entry = plp[len(prompt) + j]
        lp = entry[key(t)]
        out.append(float(lp["logprob"] if isinstance(lp, dict) else lp.logprob))
    return out


class VllmScorer:
    """vLLM in this process: one `generate` call per batch, `prompt_logprobs=0`, one decoded token."""

    mode = "vllm"

    def __init__(self, model: str, *, dtype: str = "auto", max_model_len: int = 0, seed: int = 0) -> None:
        prepare_cpu_engine_env()  # no busy-spinning engine processes on a CPU box
        from vllm import LLM

        self.model = model
        kwargs: dict[str, object] = {"max_model_len": max_model_len} if max_model_len else {}
        try:
            self.llm = LLM(model=model, dtype=dtype, seed=seed, enforce_eager=True, **kwargs)
        except Exception as e:  # unknown path, bad config: the service reports it in /readyz
            raise ScorerUnavailable(f"cannot start vLLM for {model!r}: {type(e).__name__}: {e}") from e
        warm_up(self.llm)
        mc = self.llm.llm_engine.model_config
        self.dtype = str(mc.dtype).removeprefix("torch.")
        # One token is generated after the prompt (vLLM needs max_tokens >= 1 in-process).
        self.max_len = int(mc.max_model_len) - 1
        self.vocab_size = int(mc.get_vocab_size())

    def score(self, seqs: list[Seq]) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for s in seqs:
            validate(s, self.max_len, self.vocab_size)
        # prompt_logprobs=0: only the actual token's log-prob at each position (raw logits,
        # temperature 1, whatever the sampling parameters say).
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p + c) for p, c in seqs]
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        except ValueError as e:  # vLLM's input validation (length, ids): this batch, not the engine
            raise Rejected("engine_refused", f"vLLM refused the input: {e}") from e
        return [_from_prompt_logprobs(o.prompt_logprobs or [], s, int) for o, s in zip(outs, seqs, strict=True)]

    def check(self) -> None:
        if engine_dead(self.llm):
            raise ScorerUnavailable("vLLM engine core died; restart the ref service")

    def close(self) -> None:
        shut_down(self.llm)


class RemoteScorer(OpenAIClient):
    """Client of an OpenAI-compatible vLLM server (`vllm serve MODEL --served-model-name <ref model>`)."""

    mode = "remote"
    dtype = "unknown"  # the server's numerics (fp16, GPTQ/AWQ, ...) are not visible from here
    vocab_size = 0  # unknown: the server refuses out-of-vocabulary ids with a 400 (-> Rejected)

    def __init__(
        self,
        *,
        url: str,
        model: str,
        api_key: str = "",
        served_model: str = "",
        timeout_s: float = 300.0,
        concurrency: int = 8,
        prompts_per_request: int = 16,
    ) -> None:
        if not url:
            raise ScorerUnavailable("remote engine: set BURSTRL_REF_ENGINE_URL to the vLLM server's base URL")
        super().__init__(
            url=url,
            api_key=api_key,
            timeout_s=timeout_s,
            concurrency=concurrency,
            thread_name="ref-remote",
            away=ScorerUnavailable,
        )
        self.model = model
        self.prompts_per_request = prompts_per_request
        self.served_model, self.max_len = self._model_card(served_model)
        self._echo_only = False  # set once a server ignored prompt_logprobs

    def _model_card(self, served: str) -> tuple[str, int]:
        cards = self.base_models()
        if served:
            cards = [m for m in cards if m.get("id") == served]
        if not cards:
            raise ScorerUnavailable(f"remote engine {self.url} serves no base model named {served or '(any)'!r}")
        # vLLM's model card carries max_model_len; one token is generated after the prompt.
        max_len = int(cards[0].get("max_model_len") or 1 << 30) - 1
        return cards[0]["id"], max_len

    def _complete(self, body: dict) -> dict:
        resp = self._post("/v1/completions", body)
        if resp.status_code >= 500:
            raise ScorerUnavailable(f"remote engine: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:  # too long, bad token ids: the input, not the server
            raise Rejected(
                "engine_refused", f"remote engine refused the input: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        return resp.json()

    def _score_chunk(self, seqs: list[Seq]) -> list[list[float]]:
        body: dict[str, object] = {
            "model": self.served_model,
            "prompt": [p + c for p, c in seqs],  # a batch of token-id prompts in one request
            "max_tokens": 1,
            "temperature": 0.0,
        }
        if not self._echo_only:
            choices = sorted(self._complete({**body, "prompt_logprobs": 0})["choices"], key=lambda c: c["index"])
            if len(choices) != len(seqs):
                raise ScorerUnavailable(f"remote engine returned {len(choices)} choices for {len(seqs)} prompts")
            if all(c.get("prompt_logprobs") is not None for c in choices):
                # JSON object keys are strings: {"<token id>": {"logprob": ..., "rank": ...}}
                return [_from_prompt_logprobs(c["prompt_logprobs"], s, str) for c, s in zip(choices, seqs, strict=True)]
            log.warning("remote engine ignores prompt_logprobs; using echo + logprobs")
            self._echo_only = True
        # The OpenAI way: echo the prompt with each token's log-prob (first one is null).
        body = {**body, "echo": True, "logprobs": 0, "return_tokens_as_token_ids": True}
        choices = sorted(self._complete(body)["choices"], key=lambda c: c["index"])
        out = []
        for c, (p, comp) in zip(choices, seqs, strict=True):
            lps = c["logprobs"]["token_logprobs"]
            out.append([float(x) for x in lps[len(p) : len(p) + len(comp)]])
        return out

    def score(self, seqs: list[Seq]) -> list[list[float]]:
        for s in seqs:
            validate(s, self.max_len, 0)
        n = self.prompts_per_request
        futures = [self.pool.submit(self._score_chunk, seqs[i : i + n]) for i in range(0, len(seqs), n)]
        return [lp for f in futures for lp in f.result()]


def build_scorer(settings) -> RefScorer:  # noqa: ANN001 (RefSettings; imported lazily by the caller)
    """The engine the settings name; raises ScorerUnavailable when it cannot start."""
    if settings.engine == "hf":
        try:
            return HFScorer(
                settings.model, settings.device, settings.dtype, settings.max_batch_tokens, settings.logits_chunk
            )
        except (OSError, ValueError) as e:  # unknown path or hub id, bad config
            raise ScorerUnavailable(f"cannot load {settings.model!r} with transformers: {e}") from e
    if settings.engine == "vllm":
        return VllmScorer(settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len)
    if settings.engine == "remote":
        return RemoteScorer(
            url=settings.engine_url,
            model=settings.model,
            api_key=settings.engine_api_key.get_secret_value(),
            served_model=settings.engine_served_model,
            timeout_s=settings.engine_timeout_s,
            concurrency=settings.engine_concurrency,
        )
    raise ValueError(f"unknown ref engine {settings.engine!r} (hf, vllm, remote)")
