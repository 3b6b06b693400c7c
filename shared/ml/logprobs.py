"""Per-token log-probs from logits: the one definition the trainer, the ref scorer and the
probe share (torch only; no trainer or engine imports, so ref can use it without the trainer)."""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "token_logprobs_and_entropy"]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-prob of each target token. logits: [N, T, V], targets: [N, T] -> [N, T]."""
    # log_softmax in fp32: bf16 logits lose the tail that log-probs of rare tokens need.
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of each position's distribution ([N, T] each)."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy
