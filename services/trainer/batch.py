"""Turn GroupMsgs into padded tensors for one GRPO step.

Sequences are prompt + completion, right-padded (so positions need no correction).
Position j of the shifted arrays predicts token j+1; the completion's tokens sit at
positions P-1 .. P+T-2, which is where the mask, sampler and ref log-probs go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.schema import GroupMsg, unpack_f32, unpack_i32, unpack_u8


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    mask: torch.Tensor  # [N, L-1] float: 1 where a trained completion token is predicted
    sampler_logp: torch.Tensor  # [N, L-1]
    ref_logp: torch.Tensor | None  # [N, L-1]
    rewards: torch.Tensor  # [B, G]
    versions: list[int]  # policy version per group

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def collate(groups: list[GroupMsg], pad_id: int) -> Batch:
    rows = []
    for g in groups:
        p = unpack_i32(g.prompt_ids).tolist()
        for c in g.completions:
            rows.append(
                (
                    p,
                    unpack_i32(c.token_ids).tolist(),
                    unpack_f32(c.logprobs),
                    unpack_u8(c.loss_mask),
                    unpack_f32(c.ref_logprobs) if c.ref_logprobs else None,
                )
            )
    n, L = len(rows), max(len(p) + len(t) for p, t, *_ in rows)
    ids = torch.full((n, L), pad_id, dtype=torch.long)
    attn = torch.zeros((n, L), dtype=torch.long)
    mask = torch.zeros((n, L - 1))
    slp = torch.zeros((n, L - 1))
    has_ref = all(r[4] is not None for r in rows)
    rlp = torch.zeros((n, L - 1)) if has_ref else None
    for i, (p, t, lp, lm, ref) in enumerate(rows):
        P, T = len(p), len(t)
        ids[i, : P + T] = torch.tensor(p + t)
        attn[i, : P + T] = 1
        mask[i, P - 1 : P + T - 1] = torch.from_numpy(lm.astype("float32"))
        slp[i, P - 1 : P + T - 1] = torch.from_numpy(lp.copy())
        if rlp is not None and ref is not None:
            rlp[i, P - 1 : P + T - 1] = torch.from_numpy(ref.copy())
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups], dtype=torch.float32)
    return Batch(ids, attn, mask, slp, rlp, rewards, [g.policy_version for g in groups])
