"""The policy-loss family and REINFORCE++ advantages, on hand-computed cases (CPU, tiny tensors).

Each case is small enough to work out by hand; the numbers are derived in the docstrings.
Cross-checks against TRL's own CISPO and SAPO are in tests/unit/test_trainer_trl.py.
"""

import math

import pytest
import torch

from services.trainer.advantages import compute_advantages, reinforce_pp_advantages
from services.trainer.losses import LossConfig, cispo, dppo_tv, policy_loss, sapo


def _grad(cfg: LossConfig, logp, old, adv, *, sampler=None, mask=None):  # noqa: ANN001, ANN202
    leaf = logp.clone().requires_grad_(True)
    mask = torch.ones_like(logp) if mask is None else mask
    loss, stats = policy_loss(leaf, old, adv, mask, cfg, sampler_logp=sampler)
    loss.backward()
    return loss.item(), leaf.grad, stats


def test_cispo_caps_the_detached_weight_and_keeps_every_gradient():
    """old = 0, logp = log [0.5, 1, 6], A = +1, weight bounds [0, 5]:
    weights 0.5, 1, 5 (6 capped); loss = -(0.5 log 0.5 + 0 + 5 log 6) / 3 (token-mean);
    d loss / d logp = -w A / 3 = [-1/6, -1/3, -5/3]: the capped token still learns, at weight 5
    (PPO-clip would give it no gradient at all)."""
    logp = torch.log(torch.tensor([[0.5, 1.0, 6.0]]))
    cfg = LossConfig(loss="cispo", cispo_max=5.0, mismatch="none")
    loss, grad, stats = _grad(cfg, logp, torch.zeros(1, 3), torch.tensor([1.0]))
    assert loss == pytest.approx(-(0.5 * math.log(0.5) + 5 * math.log(6.0)) / 3, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1 / 6, -1 / 3, -5 / 3]]))
    assert stats["clip_high_frac"] == pytest.approx(1 / 3) and stats["clip_low_frac"] == 0.0
    # A negative advantage pushes down, capped the same way (the weight does not look at A's sign).
    _, grad, _ = _grad(cfg, logp, torch.zeros(1, 3), torch.tensor([-1.0]))
    assert torch.allclose(grad, torch.tensor([[1 / 6, 1 / 3, 5 / 3]]))
    # A lower bound: ratio 0.5 < 0.6 is lifted to 0.6.
    per_token, low, high = cispo(logp, torch.zeros(1, 3), torch.ones(1, 1), w_min=0.6, w_max=5.0)
    assert per_token[0, 0].item() == pytest.approx(-0.6 * math.log(0.5)) and low.tolist() == [[True, False, False]]


def test_sapo_gate_is_the_policy_gradient_at_the_anchor_and_decays_softly():
    """f(r) = sigmoid(tau (r - 1)) * 4 / tau. At r = 1: f = 2 / tau, f'(1) = 4 sigmoid(0)^2 = 1, so
    one token with A = 1 has loss -2 / tau_pos = -2 and gradient d(-f(r) A)/d logp = -f'(1) r = -1.
    At r = e^0.5 with A = -1 (tau_neg = 1.05): s = sigmoid(1.05 (e^0.5 - 1)), gradient
    +4 s (1 - s) e^0.5 > 0, smaller than the unclipped -A r = e^0.5, and not zero as PPO's would be."""
    cfg = LossConfig(loss="sapo", mismatch="none")
    loss, grad, stats = _grad(cfg, torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1.0]))
    assert loss == pytest.approx(-2.0) and grad.item() == pytest.approx(-1.0)
    assert stats["clip_frac"] == 0.0  # no hard clip
    _, grad, _ = _grad(cfg, torch.full((1, 1), 0.5), torch.zeros(1, 1), torch.tensor([-1.0]))
    s = 1 / (1 + math.exp(-1.05 * (math.exp(0.5) - 1)))
    assert grad.item() == pytest.approx(4 * s * (1 - s) * math.exp(0.5), rel=1e-5)
    assert 0 < grad.item() < math.exp(0.5)
    # tau picks by the advantage's sign, per token when advantages are per token.
    per_token, _, _ = sapo(torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), tau_pos=1.0, tau_neg=4.0)
    assert per_token.tolist() == [[pytest.approx(-2.0), pytest.approx(0.5)]]


def test_dppo_tv_masks_by_the_probability_change_against_the_sampler():
    """p = [0.5, 0.1, 0.9], sampler mu = [0.2, 0.1, 0.95], delta 0.2 both ways. A = +1: p - mu =
    [0.3, 0, -0.05]; token 0 rose by 0.3 > 0.2: masked. The rest: loss -r A, r = p / mu, so
    d loss / d logp = -r / 3 = [0, -1/3, -(0.9/0.95)/3]. A = -1: nothing fell by more than 0.2,
    all kept, gradient +r / 3; a token whose probability fell 0.3 would be masked."""
    logp, mu = torch.log(torch.tensor([[0.5, 0.1, 0.9]])), torch.log(torch.tensor([[0.2, 0.1, 0.95]]))
    cfg = LossConfig(loss="dppo_tv", mismatch="none", dppo_low=0.2, dppo_high=0.2)
    old = logp.clone()  # DPPO ignores the PPO anchor: its ratio is against the sampler
    _, grad, stats = _grad(cfg, logp, old, torch.tensor([1.0]), sampler=mu)
    assert torch.allclose(grad, torch.tensor([[0.0, -1 / 3, -(0.9 / 0.95) / 3]]))
    assert stats["clip_high_frac"] == pytest.approx(1 / 3) and stats["clip_low_frac"] == 0.0
    _, grad, stats = _grad(cfg, logp, old, torch.tensor([-1.0]), sampler=mu)
    assert torch.allclose(grad, torch.tensor([[2.5 / 3, 1 / 3, (0.9 / 0.95) / 3]])) and stats["clip_frac"] == 0.0
    _, low, _ = dppo_tv(
        torch.log(torch.tensor([[0.2]])), torch.log(torch.tensor([[0.5]])), -torch.ones(1, 1), low=0.2, high=0.2
    )
    assert low.tolist() == [[True]]
    with pytest.raises(ValueError, match="mismatch 'none'"):
        policy_loss(logp, old, torch.ones(1), torch.ones(1, 3), LossConfig(loss="dppo_tv"), sampler_logp=mu)
    with pytest.raises(ValueError, match="sampler"):
        policy_loss(logp, old, torch.ones(1), torch.ones(1, 3), cfg)


def test_cispo_and_dppo_refuse_sequence_ratios():
    for loss in ("cispo", "dppo_tv"):
        cfg = LossConfig(loss=loss, ratio_level="sequence", mismatch="none")
        with pytest.raises(ValueError, match="token"):
            policy_loss(
                torch.zeros(1, 2),
                torch.zeros(1, 2),
                torch.ones(1),
                torch.ones(1, 2),
                cfg,
                sampler_logp=torch.zeros(1, 2),
            )


def test_reinforce_plus_plus_whitens_rewards_over_the_batch_tokens():
    """rewards [[1, 0], [0, 0]], trained tokens per completion n = [2, 1, 1, 2] (6 in all).
    Token-weighted mean = (1*2) / 6 = 1/3; unbiased variance = (2 (2/3)^2 + (1/3)^2 + (1/3)^2 +
    2 (1/3)^2) / 5 = (12/9) / 5 = 4/15. A = (r - 1/3) / sqrt(4/15): a group with no spread
    (the second) still gets a signal, unlike GRPO's."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    a = compute_advantages("reinforce_plus_plus", rewards, mask=mask)
    sd = math.sqrt(4 / 15 + 1e-8)
    assert torch.allclose(a, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1 / 3]) / sd, atol=1e-6)
    assert (a * mask.sum(-1)).sum().abs() < 1e-5  # zero token-weighted mean


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_first():
    """Group means 0.5 and 0: scores [0.5, -0.5, 0, 0]; with n = [2, 1, 1, 2] the token mean is
    (0.5*2 - 0.5*1) / 6 = 1/12 and the unbiased variance sum_i n_i (s_i - 1/12)^2 / 5 =
    (2 (5/12)^2 + (7/12)^2 + (1/12)^2 + 2 (1/12)^2) / 5 = (50 + 49 + 1 + 2) / 144 / 5 = 102/720."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    a = compute_advantages("reinforce_plus_plus_baseline", rewards, mask=mask)
    sd = math.sqrt(102 / 720 + 1e-8)
    assert torch.allclose(a, (torch.tensor([0.5, -0.5, 0.0, 0.0]) - 1 / 12) / sd, atol=1e-6)
    with pytest.raises(ValueError, match="mask"):
        compute_advantages("reinforce_plus_plus", rewards)


def _verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's torch_functional.masked_whiten, as written there (masked_var unbiased)."""
    mean = (values * mask).sum() / mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_plus_plus_matches_verls_token_level_definition(baseline):  # noqa: ANN001
    """verl broadcasts each completion's score to its tokens and whitens the [N, T] tensor."""
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 3, (3, 4), generator=g).float()
    mask = (torch.rand(12, 7, generator=g) > 0.3).float()
    scores = rewards - rewards.mean(dim=1, keepdim=True) if baseline else rewards
    theirs = _verl_masked_whiten(scores.reshape(-1, 1) * mask, mask) * mask
    ours = reinforce_pp_advantages(rewards, mask, baseline=baseline)
    assert torch.allclose(ours.reshape(-1, 1) * mask, theirs, atol=1e-5)
