"""One optimizer batch of GRPO-family training: advantages, mini-batches, data parallelism.

`Learner` owns the model's optimizer and LR scheduler and turns a list of groups into
updates; it knows nothing of Redis or the store (loop.py does), so it is tested alone.

Data parallelism: every rank holds the whole batch (rank 0 reads it from the bus and
broadcasts it as msgpack bytes, never pickle); within each mini-batch rank r trains the
groups r, r+W, r+2W, ... Losses are normalised by the mini-batch's *global* token and
sequence counts and gradients are summed across ranks, so W processes take exactly the
step one process takes on the same global batch (up to float summation order).

Under FSDP (services/trainer/sharding.py) the same split holds, but FSDP's reduce-scatter sums
the gradients, and every forward and backward is a collective: a rank with fewer passes in a
mini-batch runs idle ones (a two-token forward, a zero backward) so all ranks run as many.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from services.trainer.advantages import compute_advantages, compute_turn_advantages, kl_penalised_rewards
from services.trainer.batch import Batch, collate
from services.trainer.corrections import m2po_cutoff
from services.trainer.losses import LossConfig, lr_lambda, policy_loss
from services.trainer.optim import build_optimizer
from services.trainer.sharding import is_sharded
from services.trainer.stats import MEAN_KEYS, finish
from shared.job import JobSpec
from shared.ml.chunked_logprobs import check_model, head_params, model_token_logprobs, resolve_logits_chunk
from shared.schema import GroupMsg


class Aborted(Exception):
    """Stop was requested before the batch's first optimizer step: nothing was applied."""


@dataclass
class TrainResult:
    stats: dict[str, float] = field(default_factory=dict)
    grad_norm: float = 0.0
    fwd_bwd_s: float = 0.0
    optim_s: float = 0.0
    tokens: int = 0
    updates: int = 0
    lr: float = 0.0


def loss_config(spec: JobSpec) -> LossConfig:
    a = spec.algorithm
    return LossConfig(
        loss=a.loss,
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        ratio_level=a.ratio_level,
        aggregation=a.aggregation,
        # Dr.GRPO's constant normaliser: the longest a completion can be. For a multi-turn
        # episode that is the episode's cap (turns and observations), not one turn's.
        max_tokens=spec.env.max_tokens if spec.env.name else spec.sampling.max_tokens,
        mismatch=a.mismatch,
        tis_cap=spec.tis_cap,
        mismatch_min=a.mismatch_min,
        kl_coef=spec.kl_coef if a.kl_in == "loss" else 0.0,
        kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        cispo_min=a.cispo_min,
        cispo_max=a.cispo_max,
        sapo_tau_pos=a.sapo_tau_pos,
        sapo_tau_neg=a.sapo_tau_neg,
        dppo_low=a.dppo_low,
        dppo_high=a.dppo_high,
        icepop_low=a.icepop_low,
        icepop_high=a.icepop_high,
        geo_low=a.geo_low,
        geo_high=a.geo_high,
        m2po_tau=a.m2po_tau,
    )


def split_groups(n_groups: int, parts: int) -> list[list[int]]:
    """Contiguous, as even as possible (the first n % parts chunks get one more)."""
    base, extra = divmod(n_groups, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


class Learner:
    def __init__(
        self,
        model: torch.nn.Module,
        spec: JobSpec,
        *,
        pad_id: int,
        grad_clip: float,
        device: str = "cpu",
        world: int = 1,
        rank: int = 0,
        micro_batch_tokens: int = 0,
        optimizer: str = "adamw",
        logits_chunk: int = 0,
    ) -> None:
        self.model, self.spec, self.pad_id, self.grad_clip, self.device = model, spec, pad_id, grad_clip, device
        self.world, self.rank = world, rank
        self.micro_batch_tokens = micro_batch_tokens
        # Log-probs come from the head a chunk of tokens at a time (shared/ml/chunked_logprobs.py):
        # fp32 [tokens, vocab] logits never exist for a whole pass. A model it cannot run is
        # refused here, at start-up, not at the first batch.
        check_model(model)
        self.logits_chunk = resolve_logits_chunk(logits_chunk, int(head_params(model)[0].shape[0]))
        self.sharded = is_sharded(model)  # FSDP2: gradients arrive reduce-scattered, passes must match
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.params, optimizer, lr=spec.learning_rate)  # adamw | adamw8bit
        a = spec.algorithm
        total = spec.steps * a.ppo_epochs * a.minibatches  # scheduler steps once per optimizer step
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(a.lr_schedule, a.warmup_steps, total))
        self.cfg = loss_config(spec)

    # -- helpers ---------------------------------------------------------------------
    def _forward(self, b: Batch, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Trainer log-probs and entropies of `rows`, trimmed to their longest sequence."""
        idx = torch.tensor(rows, dtype=torch.long)
        attn = b.attention_mask[idx]
        length = int(attn.sum(dim=1).max())
        ids = b.input_ids[idx, :length].to(self.device)
        logp, ent = model_token_logprobs(
            self.model, ids, attn[:, :length].to(self.device), chunk=self.logits_chunk, with_entropy=True
        )
        return logp, ent, length - 1

    def _chunks(self, lengths: list[int], rows: list[int]) -> list[list[int]]:
        """`rows` as forward/backward passes: longest first, each at most `micro_batch_tokens`
        padded tokens (rows x its longest row; at least one row). One pass pads every row to
        the batch's longest; with long, uneven completions that is most of the compute. The
        losses carry the mini-batch's token and sequence counts, so accumulating the passes'
        gradients gives the same update as one pass. `lengths`: every row's unpadded length."""
        if self.micro_batch_tokens <= 0:
            return [rows] if rows else []
        order = sorted(rows, key=lambda r: -lengths[r])
        out: list[list[int]] = []
        for r in order:
            if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= self.micro_batch_tokens:
                out[-1].append(r)
            else:
                out.append([r])
        return out

    def _sync_grads(self) -> None:
        """Sum gradients across ranks (each rank's loss already carries the global denominator)."""
        if self.world == 1 or self.sharded:  # FSDP reduce-scatters (sums) them in backward
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p).to(p.dtype)
            off += n

    def _idle_passes(self, passes: list[list[list[int]]]) -> list[int]:
        """Per mini-batch, how many passes this rank must add to run as many as the busiest
        rank (FSDP only: each forward and backward all-gathers, so the counts must agree)."""
        if not self.sharded or self.world == 1:
            return [0] * len(passes)
        mine = torch.tensor([len(c) for c in passes], dtype=torch.long)
        most = mine.clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return (most - mine).tolist()

    def _idle_pass(self, b: Batch, *, backward: bool) -> None:
        """A pass that joins the other ranks' collectives and adds nothing to the gradients."""
        ids = b.input_ids[:1, :2].to(self.device)
        logits = self.model(input_ids=ids).logits
        if backward:
            (logits.sum() * 0.0).backward()

    def _all_cat(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D tensor, concatenated in rank order (ranks may hold different lengths)."""
        if self.world == 1:
            return x
        n = torch.tensor([x.numel()], dtype=torch.long, device=x.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        longest = max(int(s) for s in sizes)
        padded = torch.cat([x, x.new_zeros(longest - x.numel())])
        out = [torch.zeros_like(padded) for _ in range(self.world)]
        dist.all_gather(out, padded)
        return torch.cat([o[: int(s)] for o, s in zip(out, sizes, strict=True)])

    def _m2po_cut(self, b: Batch, chunks: list[list[int]], old: list[torch.Tensor]) -> float:
        """M2PO's cutoff over one mini-batch on every rank: its squared log-ratios
        trainer/sampler, gathered, so each pass masks as one pass over the batch would."""
        sq = [torch.zeros(0, device=self.device)]
        for rows, o in zip(chunks, old, strict=True):
            idx = torch.tensor(rows, dtype=torch.long)
            m = b.mask[idx, : o.shape[1]].bool().to(self.device)
            d = o - b.sampler_logp[idx, : o.shape[1]].to(self.device)
            sq.append((d * d)[m])
        return m2po_cutoff(self._all_cat(torch.cat(sq).float()), self.cfg.m2po_tau)

    def _all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    # -- one batch ---------------------------------------------------------------------
    def train_batch(self, groups: list[GroupMsg], should_stop: Callable[[], bool] = lambda: False) -> TrainResult:
        """Advantages, then ppo_epochs x minibatches optimizer steps on `groups`.

        `should_stop` is polled before each optimizer step; before the first one it raises
        Aborted (nothing applied, the groups can be trained later), after it the batch is
        finished so the weights never hold half a batch.
        """
        spec, a, cfg = self.spec, self.spec.algorithm, self.cfg
        b = collate(groups, self.pad_id)
        g_size = b.rewards.shape[1]
        rewards = b.rewards
        extra: dict[str, float] = {}
        if a.kl_in == "reward" and spec.kl_coef > 0.0 and b.ref_logp is not None:
            rewards, kl_r = kl_penalised_rewards(
                rewards, b.sampler_logp, b.ref_logp, b.mask, kl_coef=spec.kl_coef, estimator=a.kl_estimator
            )
            extra["kl_reward"] = float(kl_r)
        if a.advantage_level == "turn":
            # Per-token [N, T], like distill's: the loss and the row slicing below take it as is.
            adv = compute_turn_advantages(
                a.advantage,
                rewards,
                b.turn_starts,
                b.turn_rewards,
                offsets=b.offsets,
                lengths=b.lengths,
                mask=b.mask,
            )
        else:
            adv = compute_advantages(
                a.advantage,
                rewards,
                sampler_logp=b.sampler_logp,
                ref_logp=b.ref_logp,
                mask=b.mask,
                reward_weight=a.distill_reward_weight,
            )
        if (turns := b.turns_mean) is not None:
            extra["turns_mean"] = turns  # multi-turn batches only: single-turn metrics stay as they were

        mbs = split_groups(len(groups), a.minibatches)
        local = [[r for gi in mb[self.rank :: self.world] for r in range(gi * g_size, (gi + 1) * g_size)] for mb in mbs]
        counts = [
            (float(b.mask[[r for gi in mb for r in range(gi * g_size, (gi + 1) * g_size)]].sum()), len(mb) * g_size)
            for mb in mbs
        ]
        lengths = b.attention_mask.sum(dim=1).tolist()
        passes = [self._chunks(lengths, rows) for rows in local]
        idle = self._idle_passes(passes)
        res = TrainResult(tokens=b.tokens)
        self.model.train()
        t0 = time.perf_counter()
        old: dict[tuple[int, int], torch.Tensor] = {}
        # M2PO masks by the whole mini-batch's log-ratios: when one pass sees only part of it
        # (micro-batches, ranks), the anchor is needed before the first backward.
        m2po_split = cfg.mismatch == "m2po" and (self.world > 1 or any(len(c) > 1 for c in passes))
        anchored = a.ppo_epochs * a.minibatches > 1 or m2po_split  # the same on every rank
        if anchored:
            # The PPO anchor: log-probs under the weights the batch started from.
            with torch.no_grad():
                for i, chunks in enumerate(passes):
                    for j, rows in enumerate(chunks):
                        old[i, j] = self._forward(b, rows)[0].detach()
                    for _ in range(idle[i]):
                        self._idle_pass(b, backward=False)
        cuts: list[float | None] = [None] * len(passes)
        if cfg.mismatch == "m2po" and anchored:  # a collective: a rank with no rows takes part too
            cuts = [self._m2po_cut(b, c, [old[i, j] for j in range(len(c))]) for i, c in enumerate(passes)]
        res.fwd_bwd_s += time.perf_counter() - t0

        sums: dict[str, float] = {}
        local_tokens = 0.0
        loss_sum = 0.0
        for _epoch in range(a.ppo_epochs):
            for i, chunks in enumerate(passes):
                if should_stop() and res.updates == 0:
                    self.opt.zero_grad(set_to_none=True)
                    raise Aborted
                t0 = time.perf_counter()
                for j, rows in enumerate(chunks):
                    logp, ent, t_len = self._forward(b, rows)
                    idx = torch.tensor(rows, dtype=torch.long)
                    mask = b.mask[idx, :t_len].to(self.device)
                    adv_rows = adv[idx] if adv.dim() == 1 else adv[idx, :t_len]
                    ref = b.ref_logp[idx, :t_len].to(self.device) if b.ref_logp is not None else None
                    loss, st = policy_loss(
                        logp,
                        old[i, j] if (i, j) in old else logp.detach(),
                        adv_rows.to(self.device),
                        mask,
                        cfg,
                        sampler_logp=b.sampler_logp[idx, :t_len].to(self.device),
                        ref_logp=ref,
                        entropy=ent if cfg.entropy_coef > 0.0 else ent.detach(),
                        n_tokens=counts[i][0],
                        n_seqs=counts[i][1],
                        m2po_cut=cuts[i],
                    )
                    loss.backward()
                    n = float(mask.sum())
                    local_tokens += n
                    loss_sum += st.pop("loss")
                    st.pop("pg_loss", None)
                    for k, v in st.items():
                        sums[k] = sums.get(k, 0.0) + v * n
                for _ in range(idle[i]):
                    self._idle_pass(b, backward=True)
                t1 = time.perf_counter()
                self._sync_grads()
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
                res.grad_norm += float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                res.updates += 1
                t2 = time.perf_counter()
                res.fwd_bwd_s += t1 - t0
                res.optim_s += t2 - t1

        # A fixed key list: every rank must all-reduce the same vector, even one with no rows.
        keys = MEAN_KEYS + (["kl_ref"] if b.ref_logp is not None else [])
        reduced = self._all_sum([sums.get(k, 0.0) for k in keys] + [local_tokens, loss_sum])
        total_tokens = max(reduced[-2], 1.0)
        res.stats = finish({k: v / total_tokens for k, v in zip(keys, reduced[:-2], strict=True)})
        res.stats["loss"] = reduced[-1] / max(res.updates, 1)  # per-update losses are rank partial sums
        res.stats.update(extra)
        res.grad_norm /= max(res.updates, 1)
        res.lr = float(self.sched.get_last_lr()[0])
        return res
