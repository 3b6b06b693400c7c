"""Per-token log-probs from hidden states and the output layer, a chunk of tokens at a time.

The trainer, the ref scorer and the probe all need log p(target | prefix) per token, which
the textbook way gets from fp32 logits of shape [tokens, vocab]. With a real vocabulary
(Qwen2.5: 151,936) that tensor, its log-softmax and their gradients are most of a pass's
memory (about 8 MB per token in the trainer, issue 22), so here they never exist for more
than `chunk` tokens at once:

- forward: for each chunk, logits = hidden @ W.T (in the model's dtype, as the HF head does),
  fp32 log-softmax, gather the target, optionally the entropy; only the per-token results
  are kept;
- backward (`ChunkedHeadLogprobs`, a torch.autograd.Function): each chunk's logits are
  recomputed from the saved hidden states and weight, and their gradient is turned into the
  chunk's hidden-state gradient (and the head weight's, when it trains) before the next chunk.

The arithmetic per token is the unchunked one (the same fp32 log_softmax over the same
logits, the same backward steps), so values and gradients are `shared.ml.logprobs`'s up to
the last bit a matmul over fewer rows may round differently (tests/unit/test_chunked_logprobs.py).

`model_token_logprobs` runs an HF causal LM so: it asks the model for no logits
(`logits_to_keep` of no positions), takes the final hidden states from its decoder, and
applies the head here. Models whose logits are not a plain linear map of those hidden
states (soft-capping, logit scaling, an adapter on the head) are refused at start-up by
`check_model`, never silently computed another way.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CHUNK_BYTES",
    "ChunkedHeadLogprobs",
    "UnsupportedModel",
    "auto_logits_chunk",
    "check_model",
    "chunked_token_logprobs",
    "model_hidden",
    "model_token_logprobs",
    "resolve_logits_chunk",
]

# Auto chunk: tokens per chunk such that one fp32 [chunk, vocab] buffer is about this size. A
# chunk's pass holds about two of them (logits and log-softmax, or probabilities and the
# gradient), so ~256 MiB a chunk, whatever the vocabulary: 220 tokens at Qwen2.5's 151,936,
# all of a pass at the tiny model's 259. Large enough that the head's matmul stays efficient.
CHUNK_BYTES = 128 * 2**20
MIN_AUTO_CHUNK = 32
# Config attributes of HF models whose logits are not lm_head(hidden): soft-capping (Gemma 2/3),
# a logit scale (Cohere), a logit divisor (Granite). A non-None value makes the model unsupported.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class UnsupportedModel(ValueError):
    """The model's logits are not what the chunked head computes; the message says why."""


def auto_logits_chunk(vocab_size: int) -> int:
    """Tokens per chunk for `logits_chunk = 0` (see CHUNK_BYTES)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return max(MIN_AUTO_CHUNK, CHUNK_BYTES // (4 * vocab_size))


def resolve_logits_chunk(setting: int, vocab_size: int) -> int:
    """The chunk a `logits_chunk` setting means for this vocabulary: 0 is auto; negative is an error."""
    if isinstance(setting, bool) or not isinstance(setting, int):
        raise ValueError(f"logits_chunk must be an integer (0 = auto), got {setting!r}")
    if setting < 0:
        raise ValueError(f"logits_chunk must be >= 0 (0 = auto), got {setting}")
    return setting or auto_logits_chunk(vocab_size)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit and fp32 models (bf16 logits lose the tail rare tokens need); fp64 stays fp64."""
    return torch.promote_types(weight.dtype, torch.float32)


def _chunk_forward(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: the target's log-prob and (optionally) the entropy, exactly as
    shared.ml.logprobs computes them from the full logits."""
    # The head's matmul in the model's dtype (as nn.Linear in the HF forward), log-softmax in fp32.
    lp_all = torch.log_softmax(F.linear(h, weight, bias).to(_compute_dtype(weight)), dim=-1)
    logp = lp_all.gather(-1, t[:, None])[:, 0]
    ent = None
    if with_entropy:
        # exp then multiply in place: the same values as -(lp.exp() * lp).sum(-1), one buffer fewer.
        ent = -lp_all.exp().mul_(lp_all).sum(dim=-1)
    return logp, ent


class ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden [n, H], weight [V, H], bias [V] | None, targets [n]) -> (logp [n], entropy [n]).

    Saves only its inputs (and the entropies); backward recomputes each chunk's logits and
    forms their gradient with the very elementwise steps autograd takes through the unchunked
    `log_softmax -> gather` and `-(exp(lp) * lp).sum()` graph, and torch's own log-softmax
    backward kernel, so on the same logits the gradient is bit-for-bit autograd's. At most three
    fp32 [chunk, V] buffers are alive at once.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dtype = _compute_dtype(weight)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk):
            lp, e = _chunk_forward(hidden[s : s + chunk], weight, bias, targets[s : s + chunk], with_entropy)
            logp[s : s + chunk] = lp
            if e is not None:
                ent[s : s + chunk] = e
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk = chunk
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, dtype = hidden.shape[0], _compute_dtype(weight)
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=dtype, device=hidden.device)
        if g_ent is not None and (g_ent.numel() == 0 or not bool(g_ent.any())):
            g_ent = None  # entropy detached (or only reported): its term is zero, skip its buffers
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: torch.Tensor | None = None
        grad_b: torch.Tensor | None = None
        for s in range(0, n, chunk):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            lp_all = torch.log_softmax(F.linear(h, weight, bias).to(dtype), dim=-1)
            if g_ent is None:
                d_lp = torch.zeros_like(lp_all)
            else:
                # The entropy -(E * L).sum(), E = exp(L), as autograd differentiates it:
                # dL = g * E (the product) + (g * L) * E (through exp), g = -g_ent.
                g = g_ent[s : s + chunk, None].neg()
                d_lp = lp_all.exp()
                d_exp = (lp_all * g).mul_(d_lp)
                d_lp.mul_(g).add_(d_exp)
                del d_exp
            d_lp.scatter_add_(-1, t[:, None], g_logp[s : s + chunk, None])  # gather's backward
            gz = torch._log_softmax_backward_data(d_lp, lp_all, -1, dtype)
            del d_lp, lp_all
            gz = gz.to(hidden.dtype)  # the upcast's backward, as autograd does for .float()
            if grad_h is not None:
                torch.mm(gz, weight, out=grad_h[s : s + chunk])
            if need_w:
                grad_w = gz.t().mm(h) if grad_w is None else grad_w.addmm_(gz.t(), h)
            if need_b and bias is not None:
                grad_b = gz.sum(dim=0) if grad_b is None else grad_b.add_(gz.sum(dim=0))
            del gz
        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros_like(weight)
        if need_b and bias is not None and grad_b is None:
            grad_b = torch.zeros_like(bias)
        return grad_h, grad_w, grad_b, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int,
    bias: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob (fp32) of each target under logits hidden @ weight.T (+ bias), `chunk` tokens at a time.

    hidden: [..., H]; targets: [...] (the same leading shape); weight: [V, H]. Returns logp
    shaped like targets, and the entropy of each position's distribution with `with_entropy`.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., {hidden.shape[-1]}] does not fit a head weight of shape {list(weight.shape)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {list(targets.shape)} must have hidden's leading shape {list(hidden.shape[:-1])}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {list(bias.shape)} does not fit a head of {weight.shape[0]} outputs")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be token ids (int64), got {targets.dtype}")
    lead = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1).long()
    if t1.numel() and (int(t1.min()) < 0 or int(t1.max()) >= weight.shape[0]):
        raise ValueError(f"target ids must be in [0, {weight.shape[0]}), got [{int(t1.min())}, {int(t1.max())}]")
    logp, ent = ChunkedHeadLogprobs.apply(h2, weight, bias, t1, chunk, with_entropy)
    if with_entropy:
        return logp.view(lead), ent.view(lead)
    return logp.view(lead)


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_model(model: torch.nn.Module) -> None:
    """Raise UnsupportedModel unless the model's logits are lm_head(final hidden states) with a
    plain linear head, and its forward can be told to compute none of them."""
    lm = _causal_lm(model)
    name = type(lm).__name__
    cfg = getattr(lm, "config", None)
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(cfg, attr, None)
        if value not in (None, 0, 0.0, 1, 1.0):
            raise UnsupportedModel(
                f"{name} transforms its logits ({attr}={value}); chunked log-probs (logits_chunk) compute "
                "plain lm_head logits only: use a model without it"
            )
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        raise UnsupportedModel(
            f"{name}'s output layer is {type(head).__name__}, not a plain nn.Linear (an adapter on lm_head?); "
            "chunked log-probs (logits_chunk) apply the head's weight directly: leave lm_head out of the "
            "LoRA targets"
        )
    if "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        raise UnsupportedModel(f"{name}.forward has no logits_to_keep; chunked log-probs (logits_chunk) need it")
    if not hasattr(lm, "get_decoder"):
        raise UnsupportedModel(f"{name} has no get_decoder(): its final hidden states cannot be read")


def model_hidden(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Final (normed) hidden states [B, L, H] of an HF causal LM, computing no logits.

    The model is called through its own forward (peft's, and any wrapper's hooks, run as they
    would for logits), with `logits_to_keep` an empty index: lm_head sees zero positions. The
    decoder's output is taken with a forward hook, so the head is applied by the caller.
    """
    lm = _causal_lm(model)
    captured: list[torch.Tensor] = []

    def grab(_mod: torch.nn.Module, _inp: Any, out: Any) -> None:
        captured.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)

    handle = lm.get_decoder().register_forward_hook(grab)
    try:
        none = torch.empty(0, dtype=torch.long, device=input_ids.device)
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=none, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise UnsupportedModel(f"expected one decoder output from {type(lm).__name__}, got {len(captured)}")
    return captured[0]


def head_params(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer's weight [V, H] and bias (or None)."""
    head = _causal_lm(model).get_output_embeddings()
    return head.weight, head.bias


def model_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    chunk: int,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for every t: [B, L-1] (and the entropies),
    what `token_logprobs(model(...).logits[:, :-1], input_ids[:, 1:])` gives, chunk by chunk."""
    hidden = model_hidden(model, input_ids, attention_mask)[:, :-1]
    weight, bias = head_params(model)
    return chunked_token_logprobs(hidden, weight, input_ids[:, 1:], chunk=chunk, bias=bias, with_entropy=with_entropy)
