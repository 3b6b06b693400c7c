"""The GRPO math as pure functions (CPU, tiny tensors)."""

import torch

from services.trainer.grpo import group_advantages, kl_k3, masked_mean, policy_loss, token_logprobs


def test_group_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = group_advantages(r)
    assert torch.allclose(a.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(a[0].std(), torch.tensor(1.0), atol=1e-4)
    assert torch.all(a[1] == 0)  # a solved group carries no signal
    assert torch.allclose(group_advantages(r, scale_by_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(2, 3, 5)
    tgt = torch.randint(0, 5, (2, 3))
    lp = token_logprobs(logits, tgt)
    assert torch.allclose(lp[1, 2], torch.log_softmax(logits[1, 2], -1)[tgt[1, 2]])


def test_k3_is_nonnegative_and_zero_at_equality():
    a, b = torch.randn(100), torch.randn(100)
    assert torch.all(kl_k3(a, b) >= -1e-6)
    assert torch.allclose(kl_k3(a, a), torch.zeros(100))


def test_policy_gradient_raises_logp_of_positive_advantage():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    mask = torch.ones(2, 2)
    loss, stats = policy_loss(
        logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0
    )
    loss.backward()
    assert torch.all(logp.grad[0] < 0) and torch.all(logp.grad[1] > 0)  # descent raises row 0
    assert stats["mismatch_kl"] == 0.0 and stats["clip_frac"] == 0.0


def test_clip_stops_gradient_beyond_clip_high_for_positive_advantage():
    sampler = torch.zeros(1, 1)
    logp = torch.tensor([[0.5]], requires_grad=True)  # ratio e^0.5 > 1.28
    loss, stats = policy_loss(
        logp, sampler, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28, tis_cap=10.0
    )
    loss.backward()
    assert logp.grad.abs().item() == 0.0 and stats["clip_frac"] == 1.0


def test_masked_mean_ignores_masked_tokens():
    x = torch.tensor([[1.0, 100.0], [3.0, 100.0]])
    assert masked_mean(x, torch.tensor([[1.0, 0.0], [1.0, 0.0]])).item() == 2.0
