"""Transformers scoring engine: numerics match the trainer's forward pass (same code path)."""

from __future__ import annotations

import torch

from services.trainer.grpo import token_logprobs


class HFScorer:
    def __init__(self, model: str, device: str = "cpu") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
        self.max_len = int(getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", 1 << 30))

    @torch.no_grad()
    def score(self, prompt: list[int], completions: list[list[int]]) -> list[list[float]]:
        """Log-prob of each completion token given the prompt and the tokens before it."""
        P = len(prompt)
        L = max(P + len(c) for c in completions)
        if L > self.max_len:
            raise ValueError(f"sequence of {L} tokens exceeds the reference's context of {self.max_len}")
        ids = torch.zeros((len(completions), L), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(completions):
            ids[i, : P + len(c)] = torch.tensor(prompt + c)
            attn[i, : P + len(c)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits[:, :-1]
        lp = token_logprobs(logits, ids[:, 1:].to(self.device)).cpu()
        return [lp[i, P - 1 : P - 1 + len(c)].tolist() for i, c in enumerate(completions)]
