"""Default padded tokens per forward pass, from the model's shape, when the user sets none.

The trainer's `micro_batch_tokens` and ref's `max_batch_tokens` bound a pass's activation
memory. With chunked log-probs (shared/ml/chunked_logprobs.py) the vocabulary costs one
chunk's fp32 buffers per pass, a fixed amount; what grows with the tokens is what the decoder
layers keep (trainer: saved for backward) or hold at once (ref: one layer's temporaries). A
constant cannot fit both a 259-token toy and a 151,936-token Qwen (issue 22: 4096 tokens
asked about 36 GB there), so the defaults are a memory budget divided by those per-token
bytes, estimated from the config. Explicit settings always win; `burstrl plan` sizes them
for a given card.

The per-token counts follow services/plan/memory.py (full fine-tuning, fp32: an upper bound
for LoRA and bf16) without importing it: a role does not import another role.
"""

from __future__ import annotations

from typing import Any

from shared.ml.chunked_logprobs import resolve_logits_chunk

__all__ = [
    "REF_BUDGET_BYTES",
    "TRAINER_BUDGET_BYTES",
    "ref_pass_tokens",
    "trainer_pass_tokens",
]

# Activation budgets for one pass: room next to a 0.5B-1.5B model on a 12 GB card (the dev
# loop's 4070) and in a laptop's RAM. Bigger cards get bigger passes from the planner.
TRAINER_BUDGET_BYTES = 2 * 2**30
REF_BUDGET_BYTES = 1 * 2**30
# Floors keep passes large enough to use the hardware; the caps are the former constants,
# measured good on the tiny model (bench/trainer_passes.py), so small models behave as before.
TRAINER_MIN, TRAINER_MAX = 256, 4096
REF_MIN, REF_MAX = 256, 8192
_ROUND = 64


def _dims(config: Any) -> tuple[int, int, int, int, int, int]:
    """(layers, hidden, intermediate, q_dim, kv_dim, vocab) of an HF config."""
    h = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or h // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * h)
    return int(config.num_hidden_layers), h, inter, heads * head_dim, kv_heads * head_dim, int(config.vocab_size)


def _fit(budget: float, per_token: float, vocab: int, chunk: int, lo: int, hi: int) -> int:
    """Most tokens n (rounded, clamped) with n * per_token + one chunk's log-prob buffers <= budget,
    the chunk being min(chunk, n): 3 fp32 [tokens, vocab] tensors (logits, log-softmax, gradient)."""
    head = 3 * 4 * vocab
    n = int(budget // (per_token + head))  # the whole pass fits in one chunk
    if n > chunk:
        n = int((budget - head * chunk) // per_token)
    return max(lo, min(hi, n // _ROUND * _ROUND))


def trainer_pass_tokens(
    config: Any,
    *,
    setting: int | None = None,
    logits_chunk: int = 0,
    gradient_checkpointing: bool = False,
    budget: float = TRAINER_BUDGET_BYTES,
) -> int:
    """`setting` (micro_batch_tokens) when the user gave one, else the padded tokens per trainer
    pass whose activations fit `budget` bytes."""
    if setting is not None:
        return setting
    layers, h, i, q, kv, vocab = _dims(config)
    # Saved per token per layer (fp32): both norms' inputs and outputs, q/k/v/o inputs and
    # outputs, the MLP's gate/up/act outputs and down's input.
    layer = 4 * (8 * h + 2 * q + 2 * kv + 4 * i)
    per_token = (4 * h * layers + layer) if gradient_checkpointing else layers * layer
    per_token += 3 * 4 * h  # final norm and the head's input
    chunk = resolve_logits_chunk(logits_chunk, vocab)
    return _fit(budget, per_token, vocab, chunk, TRAINER_MIN, TRAINER_MAX)


def ref_pass_tokens(
    config: Any, *, setting: int | None = None, logits_chunk: int = 0, budget: float = REF_BUDGET_BYTES
) -> int:
    """`setting` (max_batch_tokens) when the user gave one, else the padded tokens per ref forward
    pass (no autograd) that fit `budget` bytes."""
    if setting is not None:
        return setting
    _layers, h, i, q, kv, vocab = _dims(config)
    # One layer's temporaries at a time (fp32) plus the residual stream and the final hidden states.
    per_token = 4 * (4 * h + q + 2 * kv + 3 * i)
    chunk = resolve_logits_chunk(logits_chunk, vocab)
    return _fit(budget, per_token, vocab, chunk, REF_MIN, REF_MAX)
