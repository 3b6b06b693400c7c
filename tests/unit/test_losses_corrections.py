"""Mismatch corrections (IcePop, Geo-RS, M2PO) and the per-step stats, on hand-computed cases."""

import math

import pytest
import torch

from services.trainer.corrections import m2po_cutoff, mismatch_correction
from services.trainer.losses import LossConfig, policy_loss
from services.trainer.stats import ess, finish, mismatch_stats, normalised_ess


def test_icepop_keeps_the_ratio_inside_its_window_and_zeroes_the_rest():
    """Ratios old/sampler 0.4, 1.0, 1.9, 2.5 with [0.5, 2.0]: M(k) = k inside, 0 outside."""
    ratios = torch.tensor([[0.4, 1.0, 1.9, 2.5]])
    c = mismatch_correction(ratios.log(), torch.zeros(1, 4), torch.ones(1, 4), mode="icepop", icepop_bounds=(0.5, 2.0))
    assert torch.allclose(c.weight, torch.tensor([[0.0, 1.0, 1.9, 0.0]]))
    assert c.masked.tolist() == [[True, False, False, True]] and not c.truncated.any()


def test_icepop_is_token_mask_with_both_bounds():
    g = torch.Generator().manual_seed(0)
    old, sampler = -torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    a = mismatch_correction(old, sampler, mask, mode="icepop", icepop_bounds=(0.5, 2.0))
    b = mismatch_correction(old, sampler, mask, mode="token_mask", floor=0.5, cap=2.0)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.masked, b.masked) and a.masked.any()


def test_geo_mask_rejects_by_the_geometric_mean_of_the_trained_tokens():
    """Log-ratios per row: [0.02, -0.01] (mean 0.005, e^0.005 = 1.005: kept), [0.03, 0.0] (mean
    0.015, 1.0151 > 1.01: rejected), [0.5, -0.005] with the 0.5 token masked out (mean -0.005:
    kept; the untrained token does not count). Kept sequences weigh 1: rejection, no IS weight."""
    diff = torch.tensor([[0.02, -0.01], [0.03, 0.0], [0.5, -0.005]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
    c = mismatch_correction(diff, torch.zeros(3, 2), mask, mode="geo_mask", geo_bounds=(0.99, 1.01))
    assert c.weight.tolist() == [[1.0], [0.0], [1.0]]
    assert c.masked.tolist() == [[False, False], [True, True], [False, False]]
    # The product of the same ratios would be far outside: a long sequence is not penalised for length.
    long = torch.full((1, 400), 0.005)
    assert mismatch_correction(long, torch.zeros(1, 400), torch.ones(1, 400), mode="geo_mask").weight.item() == 1.0
    assert mismatch_correction(long, torch.zeros(1, 400), torch.ones(1, 400), mode="sequence_mask").weight.item() == 0.0


def test_m2po_cutoff_masks_the_largest_until_the_mean_is_at_most_tau():
    """Squared log-ratios 0, 0.01, 0.02, 0.09, 1.0. Sorted prefix means: 0, 0.005, 0.01, 0.03,
    0.224. tau 0.04: the first four pass (0.03), so only 1.0 is masked. tau 0.02: three pass,
    0.09 and 1.0 are masked. tau 0.25: nothing to mask."""
    sq = torch.tensor([1.0, 0.0, 0.09, 0.02, 0.01])
    assert m2po_cutoff(sq, 0.04) == pytest.approx(0.09)
    assert m2po_cutoff(sq, 0.02) == pytest.approx(0.02)
    assert m2po_cutoff(sq, 0.25) == math.inf and m2po_cutoff(torch.zeros(0), 0.04) == math.inf
    assert m2po_cutoff(torch.tensor([0.5, 0.6]), 0.04) == -1.0  # even the smallest is above: all masked


def test_m2po_cutoff_masks_ties_together():
    """0.01, 0.05, 0.05, 0.05 with tau 0.035: prefix means 0.01, 0.03, 0.0367. Keeping two would
    split the run of 0.05s (which one?), so all three go: the mask does not depend on token order."""
    sq = torch.tensor([0.05, 0.01, 0.05, 0.05])
    assert m2po_cutoff(sq, 0.035) == pytest.approx(0.01)
    assert m2po_cutoff(sq.flip(0), 0.035) == pytest.approx(0.01)


def test_m2po_weights_kept_tokens_by_the_untruncated_ratio():
    """Log-ratios 0.1, -0.1, 1.0, 0.0 (squares 0.01, 0.01, 1, 0): the mean 0.255 > 0.04; masking
    the 1.0 leaves (0.01 + 0.01 + 0) / 3 = 0.0067. Kept weights are e^0.1, e^-0.1, 1 (no cap)."""
    diff = torch.tensor([[0.1, -0.1], [1.0, 0.0]])
    c = mismatch_correction(diff, torch.zeros(2, 2), torch.ones(2, 2), mode="m2po", m2po_tau=0.04)
    assert torch.allclose(c.weight, torch.tensor([[math.exp(0.1), math.exp(-0.1)], [0.0, 1.0]]))
    assert c.masked.tolist() == [[False, False], [True, False]]
    # A cutoff computed over a larger batch (the learner's, across passes) overrides the local one.
    c = mismatch_correction(diff, torch.zeros(2, 2), torch.ones(2, 2), mode="m2po", m2po_cut=0.005)
    assert c.masked.tolist() == [[True, True], [True, False]]


def _areal_keep(sq: torch.Tensor, tau: float) -> torch.Tensor:
    """AReaL's _get_m2po_loss_mask on one batch: sort descending, drop the head until the mean of
    the rest is below tau (it keeps at least one token)."""
    v, idx = torch.sort(sq, descending=True)
    suffix_mean = v.flip(0).cumsum(0).flip(0) / torch.arange(len(v), 0, -1)
    below = torch.where(suffix_mean < tau)[0]
    n_drop = int(below[0]) if len(below) else len(v) - 1
    keep = torch.ones_like(v, dtype=torch.bool)
    keep[:n_drop] = False
    return keep[torch.argsort(idx)]


@pytest.mark.parametrize("seed", range(5))
def test_m2po_masks_the_same_tokens_as_areal(seed):  # noqa: ANN001
    """On continuous values (no ties, no value exactly at tau) the two rules agree token for token."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(300, generator=g) * 0.3 * (1 + 4 * (torch.rand(300, generator=g) > 0.9))  # a heavy tail
    sq = d * d
    kept = sq <= m2po_cutoff(sq, 0.04)
    assert torch.equal(kept, _areal_keep(sq, 0.04))
    assert float(sq[kept].mean()) <= 0.04 < float(sq.mean())
    assert 0 < int((~kept).sum()) < 300


def test_ess_and_the_mismatch_stats_by_hand():
    """ESS = (sum w)^2 / (n sum w^2): weights 1, 1, 0, 0 -> 4 / (4 * 2) = 0.5; 2, 0, 0, 0 -> 4 / 16."""
    mask = torch.ones(1, 4)
    assert ess(torch.tensor([[1.0, 1.0, 0.0, 0.0]]), mask) == pytest.approx(0.5)
    assert ess(torch.tensor([[2.0, 0.0, 0.0, 0.0]]), mask) == pytest.approx(0.25)
    assert normalised_ess(0.0, 0.0) == 0.0
    # Log-ratios old - sampler 0.1 and -0.3: m2 = (0.01 + 0.09) / 2 = 0.05.
    old, sampler, m = torch.tensor([[0.1, -0.3]]), torch.zeros(1, 2), torch.ones(1, 2)
    no = torch.zeros(1, 2, dtype=torch.bool)
    st = mismatch_stats(old, sampler, m, torch.ones(1, 1), no, torch.tensor([[True, False]]))
    assert st["m2"] == pytest.approx(0.05) and st["mask_frac"] == 0.5 and st["is_frac"] == 0.5
    assert st["mismatch_kl"] == pytest.approx(0.1)  # mean(sampler - old)
    r = torch.exp(torch.tensor([0.1, -0.3]))
    assert st["r_mean"] == pytest.approx(float(r.mean())) and st["r_sq_mean"] == pytest.approx(float((r * r).mean()))
    out = finish(st)
    assert (
        "w_mean" not in out
        and out["ess"] == 1.0
        and out["ess_raw"] == pytest.approx(float(r.mean() ** 2 / (r * r).mean()))
    )


@pytest.mark.parametrize(
    "mode", ["token_truncate", "token_mask", "sequence_mask", "icepop", "geo_mask", "m2po", "none"]
)
def test_every_correction_reports_m2_ess_and_fractions(mode):  # noqa: ANN001
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(16, 5, generator=g) * 2
    sampler = old + 0.4 * torch.randn(16, 5, generator=g)
    logp = old.clone().requires_grad_(True)
    cfg = LossConfig(mismatch=mode, mismatch_min=0.7 if mode.endswith("_mask") else 0.0, geo_low=0.9, geo_high=1.1)
    loss, st = policy_loss(logp, old, torch.randn(16, generator=g), torch.ones(16, 5), cfg, sampler_logp=sampler)
    st = finish(st)
    for k in ("m2", "mask_frac", "is_frac", "clip_frac", "ess", "ess_raw"):
        assert math.isfinite(st[k]), k
    assert st["m2"] == pytest.approx(float(((old - sampler) ** 2).mean()), rel=1e-5)
    assert 0.0 < st["ess"] <= 1.0 and 0.0 < st["ess_raw"] <= 1.0
    if mode in ("token_mask", "sequence_mask", "icepop", "geo_mask", "m2po"):
        assert 0.0 < st["mask_frac"] < 1.0  # these inputs make every mask act, but not on everything
    if mode == "none":
        assert st["ess"] == 1.0 and st["mask_frac"] == 0.0


def test_stats_stay_finite_for_a_sampler_far_off():
    """A token the sampler gave log-prob -100 and the trainer -1: ratio e^99, past fp32's e^88.
    The stats (a metric point is JSON) stay finite; the loss's weight is truncated as usual."""
    old, sampler, mask = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-100.0, -1.0]]), torch.ones(1, 2)
    logp = old.clone().requires_grad_(True)
    loss, st = policy_loss(logp, old, torch.ones(1), mask, LossConfig(), sampler_logp=sampler)
    st = finish(st)
    assert all(math.isfinite(v) for v in st.values()), st
    assert st["m2"] == pytest.approx(99.0**2 / 2) and math.isfinite(loss.item())
