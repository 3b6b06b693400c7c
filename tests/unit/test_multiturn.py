"""Multi-turn trajectories in the trainer: tool/observation tokens carry no gradient.

Checked on the loss itself, through the trainer's real path (collate -> Learner ->
policy_loss, with the KL and entropy terms on): adding noise to the logits at every
position whose target is an observation token (or prompt/padding) changes neither the
loss nor any parameter's gradient, bit for bit, and the logits' gradient there is exactly
zero; the same noise at a generated token's position does change them (the check is live).
"""

from __future__ import annotations

import pytest
import torch

from services.trainer.batch import collate
from shared.job import JobSpec
from shared.schema import unpack_u8
from tests.support.multiturn import PROMPT, grads_and_loss, groups


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

    g0, loss0, dlogits = grads_and_loss(spec, gs, None)
    g1, loss1, _ = grads_and_loss(spec, gs, untrained)
    assert loss0 == loss1
    assert all(torch.equal(a, c) for a, c in zip(g0, g1, strict=True))
    # d loss / d logits is exactly zero wherever the target is not a generated token
    assert torch.count_nonzero(dlogits[untrained.bool()]) == 0
    assert torch.count_nonzero(dlogits[~untrained.bool()]) > 0

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
