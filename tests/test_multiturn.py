"""Multi-turn trajectories in the trainer: tool/observation tokens carry no gradient.

Checked on the loss itself, through the trainer's real path (collate -> Learner ->
policy_loss, with the KL and entropy terms on): adding noise to the final hidden states
(the head's input, position by position) at every position whose target is an observation
token (or prompt/padding) changes neither the loss nor any parameter's gradient, bit for
bit, and the gradient there is exactly zero; the same noise at a generated token's position does change them (the check is live).
"""

from __future__ import annotations

import pytest
import torch

from services.trainer.batch import collate
from services.trainer.learner import Learner
from shared.job import JobSpec
from shared.schema import Completion, GroupMsg, pack_f32, pack_i32, pack_u8, unpack_u8

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
        GroupMsg(
            job_id="j",
            group_id=f"g{k}",
            item_id=str(k),
            prompt="",
            prompt_ids=pack_i32(PROMPT),
            policy_version=0,
            completions=[episode(4 * k + i, float(i % 2) + 0.1 * k, obs_lp) for i in range(4)],
            stage="ready",
        )
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


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_observation_tokens_carry_no_gradient(aggregation: str) -> None:
    spec = JobSpec(
        base_model="x",
        group_size=4,
        batch_size=2,
        kl_coef=0.1,
        algorithm={"aggregation": aggregation, "entropy_coef": 0.01},
    )
    gs = groups()
    b = collate(gs, pad_id=0)
    assert b.ref_logp is not None
    # Position t of the shifted arrays predicts token t+1; logits have L positions, the
    # last of which predicts nothing. Untrained positions: observations, prompt, padding.
    n, length = b.input_ids.shape
    untrained = torch.ones(n, length)
    untrained[:, : length - 1] = 1.0 - b.mask
    # The batch's mask is each completion's loss_mask, placed after its prompt.
    row = 0
    for g in gs:
        for c in g.completions:
            lm = unpack_u8(c.loss_mask).tolist()
            assert b.mask[row, len(PROMPT) - 1 : len(PROMPT) - 1 + len(lm)].tolist() == lm and 0 in lm
            row += 1

    g0, loss0, dhidden = grads_and_loss(spec, gs, None)
    g1, loss1, _ = grads_and_loss(spec, gs, untrained)
    assert loss0 == loss1
    assert all(torch.equal(a, c) for a, c in zip(g0, g1, strict=True))
    # d loss / d hidden (so d loss / d logits) is exactly zero wherever the target is not a generated token
    assert torch.count_nonzero(dhidden[untrained.bool()]) == 0
    assert torch.count_nonzero(dhidden[~untrained.bool()]) > 0

    # Control: the same noise at one generated token's position does change the gradient.
    trained = torch.zeros(n, length)
    i, t = (b.mask == 1).nonzero()[0].tolist()
    trained[i, t] = 1.0
    g2, loss2, _ = grads_and_loss(spec, gs, trained)
    assert loss2 != loss0 or not all(torch.equal(a, c) for a, c in zip(g0, g2, strict=True))


def test_observation_logprobs_are_ignored() -> None:
    """Whatever the sampler/ref log-probs recorded for observation tokens (0 by convention),
    they do not enter the loss: the mismatch weights and the KL are masked too."""
    spec = JobSpec(base_model="x", group_size=4, batch_size=2, kl_coef=0.1, algorithm={"mismatch": "sequence_mask"})
    g0, loss0, _ = grads_and_loss(spec, groups(obs_lp=0.0), None)
    g1, loss1, _ = grads_and_loss(spec, groups(obs_lp=-7.0), None)
    assert loss0 == loss1
    assert all(torch.equal(a, c) for a, c in zip(g0, g1, strict=True))
