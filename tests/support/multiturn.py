"""Multi-turn trainer cases shared by the observation-mask and turn-advantage tests: a small random
Qwen2 policy, episodes with generated and observation spans, and one Learner batch's gradients."""

from __future__ import annotations

import torch

from services.trainer.learner import Learner
from shared.job import JobSpec
from shared.schema import Completion, GroupMsg, pack_f32, pack_i32, pack_u8
from tests.support.trainer_groups import ready_group

PROMPT = [5, 6, 7]
# generated (1) | observation (0) | generated (1) | observation (0) | generated (1)
LAYOUT = [(1, 4), (0, 3), (1, 2), (0, 2), (1, 3)]


def tiny_model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg)


def episode(seed: int, reward: float, obs_lp: float = 0.0) -> Completion:
    g = torch.Generator().manual_seed(seed)
    ids, mask, lps, ref = [], [], [], []
    for m, n in LAYOUT:
        ids += torch.randint(8, 40, (n,), generator=g).tolist()
        mask += [m] * n
        lps += [float(-torch.rand(1, generator=g)) - 0.5 if m else obs_lp for _ in range(n)]
        ref += [float(-torch.rand(1, generator=g)) - 0.5 if m else 10 * obs_lp for _ in range(n)]
    # seeds 3+ end early: ragged lengths, so padding is in play too
    cut = len(ids) - (seed % 3)
    return Completion(
        token_ids=pack_i32(ids[:cut]),
        logprobs=pack_f32(lps[:cut]),
        loss_mask=pack_u8(mask[:cut]),
        text="",
        finish_reason="stop",
        reward=reward,
        ref_logprobs=pack_f32(ref[:cut]),
    )


def groups(obs_lp: float = 0.0) -> list[GroupMsg]:
    return [
        ready_group(k, [episode(4 * k + i, float(i % 2) + 0.1 * k, obs_lp) for i in range(4)], PROMPT, prompt="")
        for k in range(2)
    ]


def grads_and_stats(
    spec: JobSpec, gs: list[GroupMsg], noise_at: torch.Tensor | None
) -> tuple[list, dict, torch.Tensor]:
    """One Learner batch; returns parameter grads (captured before the optimizer step),
    the step's stats (with its loss), and d loss / d final hidden states. `noise_at` [N, T]
    adds noise to the final hidden states where it is 1 (to show positions that must not
    matter do not). The head maps each position's hidden state to that position's logits
    alone, so a zero gradient there is a zero gradient on its logits: the learner computes
    log-probs from the hidden states in chunks and never holds the whole logits tensor."""
    model = tiny_model()
    learner = Learner(model, spec, pad_id=0, grad_clip=1e9)
    captured: dict = {}

    def hook(_mod, _inp, out: torch.Tensor) -> torch.Tensor:
        if noise_at is not None:
            noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)) * 5.0
            out = out + noise * noise_at[:, : out.shape[1], None]
        out.retain_grad()
        captured["hidden"] = out
        return out

    model.model.norm.register_forward_hook(hook)
    learner.opt.step = lambda *a, **k: captured.setdefault("grads", [p.grad.clone() for p in learner.params])  # type: ignore[method-assign]
    res = learner.train_batch(gs)
    return captured["grads"], res.stats, captured["hidden"].grad


def grads_and_loss(
    spec: JobSpec, gs: list[GroupMsg], noise_at: torch.Tensor | None
) -> tuple[list, float, torch.Tensor]:
    grads, stats, dhidden = grads_and_stats(spec, gs, noise_at)
    return grads, stats["loss"], dhidden
