"""The GRPO-family math as pure functions (CPU, tiny tensors)."""

import math

import pytest
import torch

from services.trainer.advantages import (
    compute_advantages,
    group_advantages,
    kl_penalised_rewards,
    rloo_advantages,
    zero_variance_groups,
)
from services.trainer.corrections import mismatch_correction
from services.trainer.losses import (
    LossConfig,
    aggregate,
    kl_k1,
    kl_k2,
    kl_k3,
    lr_lambda,
    masked_mean,
    policy_loss,
)
from shared.ml.logprobs import token_logprobs, token_logprobs_and_entropy


def test_group_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = group_advantages(r)
    assert torch.allclose(a.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(a[0].std(), torch.tensor(1.0), atol=1e-4)
    assert torch.all(a[1] == 0)  # a solved group carries no signal
    assert torch.allclose(group_advantages(r, scale_by_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_rloo_is_reward_minus_mean_of_the_others():
    r = torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    want = torch.tensor([[1 - 2 / 3, 0 - 1.0, 0 - 1.0, 2 - 1 / 3]])
    assert torch.allclose(rloo_advantages(r), want)
    assert compute_advantages("rloo", r).shape == (4,)
    assert torch.allclose(compute_advantages("dr_grpo", r), (r - r.mean()).reshape(-1))


def test_distill_advantages_are_per_token_teacher_minus_sampler():
    teacher = torch.tensor([[-1.0, -2.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    a = compute_advantages("distill", torch.zeros(1, 1), sampler_logp=sampler, ref_logp=teacher, mask=mask)
    assert torch.allclose(a, torch.tensor([[0.5, -1.0, 0.0]]))
    with pytest.raises(ValueError):
        compute_advantages("distill", torch.zeros(1, 1))


def test_zero_variance_groups_and_kl_in_reward():
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    assert zero_variance_groups(r).tolist() == [True, False]
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    ref = logp - 0.5  # k1 = +0.5 per token
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    shaped, kl = kl_penalised_rewards(r, logp, ref, mask, kl_coef=0.1, estimator="k1")
    assert torch.allclose(shaped, r - 0.1 * torch.tensor([[1.0, 0.5], [1.0, 1.0]]))
    assert math.isclose(float(kl), 0.5, rel_tol=1e-6)


def test_token_logprobs_and_entropy_match_the_definitions():
    logits = torch.randn(2, 3, 5)
    tgt = torch.randint(0, 5, (2, 3))
    lp = token_logprobs(logits, tgt)
    assert torch.allclose(lp[1, 2], torch.log_softmax(logits[1, 2], -1)[tgt[1, 2]])
    lp2, ent = token_logprobs_and_entropy(logits, tgt)
    assert torch.allclose(lp, lp2)
    p = torch.softmax(logits[0, 1], -1)
    assert torch.allclose(ent[0, 1], -(p * p.log()).sum())


def test_kl_estimators():
    a, b = torch.randn(100), torch.randn(100)
    assert torch.all(kl_k3(a, b) >= -1e-6) and torch.all(kl_k2(a, b) >= 0)
    assert torch.allclose(kl_k3(a, a), torch.zeros(100))
    assert torch.allclose(kl_k1(a, b), a - b)
    # Sampled from pi, k1 and k3 are unbiased estimates of KL(pi || ref).
    pi, ref = torch.tensor([0.7, 0.3]), torch.tensor([0.4, 0.6])
    true_kl = float((pi * (pi / ref).log()).sum())
    lp, lr = pi.log(), ref.log()
    assert math.isclose(float((pi * kl_k1(lp, lr)).sum()), true_kl, rel_tol=1e-5)
    assert math.isclose(float((pi * kl_k3(lp, lr)).sum()), true_kl, rel_tol=1e-5)


def test_aggregation_modes():
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(x, m, "token-mean").item() == pytest.approx(7 / 4)
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((1 + 4) / 2)
    assert aggregate(x, m, "seq-mean-token-sum").item() == pytest.approx(7 / 2)
    assert aggregate(x, m, "seq-mean-token-sum-norm", max_tokens=10).item() == pytest.approx(7 / 20)
    # Global denominators (data parallel): two halves sum to the whole.
    whole = aggregate(x, m, "token-mean")
    halves = aggregate(x[:1], m[:1], "token-mean", n_tokens=4) + aggregate(x[1:], m[1:], "token-mean", n_tokens=4)
    assert torch.allclose(whole, halves)
    assert masked_mean(torch.tensor([[1.0, 100.0], [3.0, 100.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])) == 2.0


def test_mismatch_weights_truncate_and_mask_at_token_and_sequence_level():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    sampler = torch.tensor([[0.0, -2.0, -0.1]])  # ratios 1, e^2 (> cap), e^0.1
    mask = torch.ones(1, 3)
    c = mismatch_correction(old, sampler, mask, mode="token_truncate", cap=2.0)
    assert torch.allclose(c.weight, torch.tensor([[1.0, 2.0, math.exp(0.1)]]))
    assert c.truncated.tolist() == [[False, True, False]] and not c.masked.any()
    c = mismatch_correction(old, sampler, mask, mode="token_mask", cap=2.0)
    assert torch.allclose(c.weight, torch.tensor([[1.0, 0.0, math.exp(0.1)]]))
    assert c.masked.tolist() == [[False, True, False]] and not c.truncated.any()
    c = mismatch_correction(old, sampler, mask, mode="sequence_truncate", cap=2.0)
    assert c.weight.shape == (1, 1) and c.weight.item() == pytest.approx(2.0) and c.truncated.all()
    c = mismatch_correction(old, sampler, mask, mode="sequence_mask", cap=100.0)
    assert c.weight.item() == pytest.approx(math.exp(2.1), rel=1e-5)
    c = mismatch_correction(old, sampler, mask, mode="token_mask", cap=10.0, floor=0.5)
    assert c.weight.tolist() == [[1.0, pytest.approx(math.exp(2)), pytest.approx(math.exp(0.1))]]
    assert not c.masked.any()


def _cfg(**kw) -> LossConfig:
    return LossConfig(**{"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0, **kw})


def test_policy_gradient_raises_logp_of_positive_advantage():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    mask = torch.ones(2, 2)
    loss, stats = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, _cfg(), sampler_logp=logp.detach())
    loss.backward()
    assert torch.all(logp.grad[0] < 0) and torch.all(logp.grad[1] > 0)  # descent raises row 0
    assert stats["mismatch_kl"] == 0.0 and stats["clip_frac"] == 0.0 and stats["is_frac"] == 0.0


def test_clip_high_stops_gradient_beyond_it_for_positive_advantage():
    old = torch.zeros(1, 1)
    logp = torch.tensor([[0.5]], requires_grad=True)  # ratio e^0.5 > 1.28
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), _cfg())
    loss.backward()
    assert logp.grad.abs().item() == 0.0 and stats["clip_frac"] == 1.0 and stats["clip_high_frac"] == 1.0


def test_asymmetric_clip_low_applies_to_negative_advantage():
    old = torch.zeros(1, 1)
    logp = torch.tensor([[math.log(0.75)]], requires_grad=True)  # ratio 0.75 < 1 - 0.2
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), _cfg())
    loss.backward()
    assert logp.grad.abs().item() == 0.0 and stats["clip_low_frac"] == 1.0


def test_mismatch_weight_scales_the_gradient_and_is_reported():
    logp = torch.zeros(1, 2, requires_grad=True)
    sampler = torch.tensor([[0.0, -3.0]])  # the sampler under-rated token 2: weight e^3 capped at 2
    loss, stats = policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), _cfg(), sampler_logp=sampler)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -1.0]]))  # token-mean over 2 tokens, x weight
    assert stats["is_frac"] == 0.5 and stats["mismatch_kl"] == pytest.approx(-1.5)
    assert stats["mismatch_k3"] == pytest.approx((math.exp(3) - 3 - 1) / 2)


def test_gspo_ratio_is_one_per_sequence():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.2, 0.6]], requires_grad=True)  # geometric-mean ratio e^0.4 > 1.28: clipped
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), _cfg(ratio_level="sequence"))
    loss.backward()
    assert torch.all(logp.grad == 0) and stats["clip_frac"] == 1.0
    logp2 = torch.tensor([[0.1, -0.1]], requires_grad=True)  # geometric mean 1: not clipped
    loss2, _ = policy_loss(logp2, old, torch.tensor([1.0]), torch.ones(1, 2), _cfg(ratio_level="sequence"))
    loss2.backward()
    assert torch.allclose(logp2.grad, torch.full((1, 2), -0.5))  # the sequence ratio spreads evenly


def test_kl_and_entropy_terms():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.full((1, 2), -1.0)
    ent = torch.tensor([[2.0, 4.0]], requires_grad=True)
    cfg = _cfg(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    loss, stats = policy_loss(
        logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2), cfg, ref_logp=ref, entropy=ent
    )
    assert loss.item() == pytest.approx(0.5 * 1.0 - 0.1 * 3.0)
    assert stats["kl_ref"] == pytest.approx(1.0) and stats["entropy"] == pytest.approx(3.0)


def test_lr_schedule_warmup_then_constant_or_cosine():
    f = lr_lambda("constant", 4, 10)
    assert [f(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    g = lr_lambda("cosine", 0, 10)
    assert g(0) == 1.0 and g(5) == pytest.approx(0.5) and g(10) == pytest.approx(0.0)
