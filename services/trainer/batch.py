"""Turn GroupMsgs into padded tensors for one GRPO step.

Sequences are prompt + completion, right-padded (so positions need no correction).
Position j of the shifted arrays predicts token j+1; the completion's tokens sit at
positions P-1 .. P+T-2, which is where the mask, sampler and ref log-probs go (and, for
turn-level advantages, where completion token j's turn is looked up: `offsets[i]` + j).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared.schema import Completion, GroupMsg, unpack_f32, unpack_i32, unpack_u8


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    mask: torch.Tensor  # [N, L-1] float: 1 where a trained completion token is predicted
    sampler_logp: torch.Tensor  # [N, L-1]
    ref_logp: torch.Tensor | None  # [N, L-1]
    rewards: torch.Tensor  # [B, G]
    versions: list[int]  # policy version per group
    # Per completion (N entries), for turn-level advantages: where its token 0 is predicted in
    # the shifted arrays (prompt length - 1), its length, and its model turns (start index in
    # its token ids, int64 [K]; step reward, float32 [K]; both empty for a single-turn one).
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    turn_starts: list[torch.Tensor] = field(default_factory=list)
    turn_rewards: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def turns_mean(self) -> float | None:
        """Mean model turns per completion, None when no completion carries turns (single-turn)."""
        if not any(len(s) for s in self.turn_starts):
            return None
        return sum(max(len(s), 1) for s in self.turn_starts) / len(self.turn_starts)


def completion_turns(c: Completion, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A completion's (turn starts int64 [K], turn rewards float32 [K]); empty when it has none.

    Turn fields that do not describe turns of this completion (lengths that differ, starts
    out of order or past its end) are dropped rather than trusted: the completion then counts
    as one turn, i.e. it gets its episode-level advantage. The trainer must not crash on one
    malformed group, and admission (loop.py) checks only the token arrays.
    """
    empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32))
    if not c.turn_starts or len(c.turn_starts) % 4 or len(c.turn_rewards) % 4:
        return empty
    starts = unpack_i32(c.turn_starts).astype(np.int64)
    rewards = unpack_f32(c.turn_rewards) if c.turn_rewards else np.zeros(len(starts), dtype=np.float32)
    ok = (
        len(rewards) == len(starts)
        and starts[0] >= 0
        and starts[-1] <= n_tokens  # a turn may be empty (a sample of no tokens), even the last
        and bool(np.all(np.diff(starts) >= 0))
        and bool(np.all(np.isfinite(rewards)))
    )
    if not ok:
        return empty
    return torch.from_numpy(starts), torch.from_numpy(rewards.astype(np.float32))


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
                    c,
                )
            )
    n, L = len(rows), max(len(p) + len(t) for p, t, *_ in rows)
    ids = torch.full((n, L), pad_id, dtype=torch.long)
    attn = torch.zeros((n, L), dtype=torch.long)
    mask = torch.zeros((n, L - 1))
    slp = torch.zeros((n, L - 1))
    has_ref = all(r[4] is not None for r in rows)
    rlp = torch.zeros((n, L - 1)) if has_ref else None
    offsets, lengths, starts, turn_rewards = [], [], [], []
    for i, (p, t, lp, lm, ref, c) in enumerate(rows):
        P, T = len(p), len(t)
        ids[i, : P + T] = torch.tensor(p + t)
        attn[i, : P + T] = 1
        mask[i, P - 1 : P + T - 1] = torch.from_numpy(lm.astype("float32"))
        slp[i, P - 1 : P + T - 1] = torch.from_numpy(lp.copy())
        if rlp is not None and ref is not None:
            rlp[i, P - 1 : P + T - 1] = torch.from_numpy(ref.copy())
        s, r = completion_turns(c, T)
        offsets.append(P - 1)
        lengths.append(T)
        starts.append(s)
        turn_rewards.append(r)
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups], dtype=torch.float32)
    return Batch(
        ids, attn, mask, slp, rlp, rewards, [g.policy_version for g in groups], offsets, lengths, starts, turn_rewards
    )
