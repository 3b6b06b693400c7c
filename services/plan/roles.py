"""One role on one group of identical cards: its settings, peak memory and seconds per step.

`placement.py` calls `plan_trainer`, `plan_rollout` and `plan_ref` for every way of giving
roles cards and compares the results. Settings come out in the services' own vocabulary
(`vocabulary.py`); the planner's finer knobs stay in the private `_settings`.

Step times are rough by design: FLOPs / (peak x `mfu`) for compute-bound work and bytes /
(bandwidth x `bw_eff`) for decode, which is bandwidth-bound.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr

from services.plan import vocabulary
from services.plan.catalog import Card
from services.plan.memory import (
    GB,
    Method,
    ServeSettings,
    TrainerKnobs,
    Workload,
    full_bytes_per_param,
    kv_bytes_per_group,
    largest_micro_batch,
    ref_memory,
    rollout_concurrency,
    rollout_memory,
    serve_weight_bytes,
    trainer_memory,
)
from services.plan.model_shape import ModelShape

# Tokens per micro-batch that keep matmuls efficient; beyond this a larger micro-batch buys little.
EFFICIENT_TOKENS = 4096
# The chunk the lean rungs assume for chunked log-probs (trainer and ref).
LOGITS_CHUNK = 1024


class Efficiency(BaseModel):
    """How much of the data-sheet numbers real code gets."""

    mfu: float = Field(default=0.4, gt=0, le=1, description="Fraction of peak FLOPS in matmul-bound work.")
    bw_eff: float = Field(default=0.7, gt=0, le=1, description="Fraction of peak bandwidth in decode.")
    host_gbs: float = Field(default=25.0, gt=0, description="Host<->card copy bandwidth for offload.")


class RolePlan(BaseModel):
    """One role on one group of identical cards."""

    role: str
    card: str
    count: int
    fits: bool
    peak_gb: float = Field(description="Peak per card with the recommended settings.")
    capacity_gb: float
    headroom_gb: float
    micro_batch: int = Field(description="Recommended rows per pass (trainer/ref) or sequences in flight (rollout).")
    max_micro_batch: int = Field(description="Largest micro-batch (or sequences in flight) that fits.")
    recommended: dict[str, Any] = Field(description="Settings of the role's service (same names), fastest that fit.")
    min_settings: dict[str, Any] = Field(description="Settings of the role's service with every memory saver on.")
    layout: dict[str, Any] = Field(default_factory=dict, description="Not settings: weights served, processes...")
    min_layout: dict[str, Any] = Field(default_factory=dict, description="`layout` for the min settings.")
    min_peak_gb: float
    peak_phase: str = ""
    time_s: float = Field(description="Seconds this role spends per optimizer step.")
    notes: list[str] = Field(default_factory=list)
    _settings: TrainerKnobs | None = PrivateAttr(default=None)  # the planner's own knobs (trainer)


def _ladder(method: Method, card: Card, k: int, shard: bool = False) -> list[TrainerKnobs]:
    """Trainer settings from fastest to leanest, each rung adding a memory saver.

    Unsharded (`shard` False), a k-card trainer is data-parallel (every card holds the whole
    model) below its FSDP rung, so a plan shards only when it says so. `shard` True: every rung
    is FSDP over the k cards, for a colocated plan, whose trainer keeps its weights and states
    resident while vLLM serves (replicas of them would take k - 1 model copies from rollout).
    bitsandbytes' savers (8-bit AdamW, a 4-bit base) are never combined with FSDP or CPU
    offload: the trainer refuses those pairs at start-up (services/trainer/quant.py).
    """
    full = method.kind == "full"
    base = TrainerKnobs(dtype=card.train_dtype, fsdp_shards=k if shard else 1)  # type: ignore[arg-type]
    chunked = base.model_copy(update={"logits_chunk": LOGITS_CHUNK})
    ckpt = chunked.model_copy(update={"gradient_checkpointing": True})
    sharded = ckpt.model_copy(update={"fsdp_shards": k})
    out = [base, chunked, ckpt]
    if k > 1 and not shard:
        out.append(sharded)
    if not shard:
        out.append(ckpt.model_copy(update={"optimizer": "adamw8bit"} if full else {"base_bits": 4}))
    if full:
        out.append(sharded.model_copy(update={"cpu_offload": True}))
    return out


def trainer_time(
    shape: ModelShape,
    method: Method,
    w: Workload,
    s: TrainerKnobs,
    card: Card,
    eff: Efficiency,
    world: int = 1,
) -> float:
    """Seconds per optimizer step on `world` cards (FSDP when s.fsdp_shards > 1, else DDP)."""
    full, k = method.kind == "full", s.fsdp_shards
    tokens = w.sequences * w.seq_len
    # Forward 1x; backward 2x for full (input and weight grads), ~1x for LoRA (input grads only).
    passes = (3 if full else 2) + (1 if s.gradient_checkpointing else 0)
    flops = world * card.train_tflops * 1e12 * eff.mfu
    compute = tokens * shape.forward_flops_per_token(w.seq_len) * passes / flops
    compute *= 1.25 if s.base_bits == 4 else 1.0  # QLoRA dequantizes every weight on every use
    trainable = shape.n_params if full else shape.lora_params(method.rank, method.targets)
    comm = 0.0
    if k > 1:  # FSDP: all-gather weights for forward and backward, reduce-scatter grads, per micro-batch
        micro_steps = math.ceil(w.sequences / (k * s.micro_batch))
        per_micro = shape.n_params * 2 * (3 if full else 2) * (k - 1) / k
        comm = micro_steps * per_micro / (card.link_gbs * 1e9)
    elif world > 1:  # DDP: one ring all-reduce of the trainable grads per step (no_sync between)
        grad_bytes = full_bytes_per_param(s)[1] if full else (4 if s.adapter_fp32 else 2)
        comm = trainable * grad_bytes * 2 * (world - 1) / world / (card.link_gbs * 1e9)
    optim = trainable * 28 / k / (card.bandwidth_gbs * 1e9 * eff.bw_eff)  # read p,g,m,v; write p,m,v
    if full and s.cpu_offload:  # grads out, params back, Adam on the host
        optim = trainable * 2 * 2 / k / (eff.host_gbs * 1e9) + trainable * 28 / k / (eff.host_gbs * 2e9)
    return max(compute, comm) + optim


def plan_trainer(
    shape: ModelShape,
    method: Method,
    w: Workload,
    card: Card,
    k: int,
    eff: Efficiency,
    extra_static: float = 0.0,
    shardable_static: float = 0.0,
    shard: bool = False,
) -> RolePlan:
    """Fastest settings that fit on k cards. `extra_static` is memory other roles pin on each
    card; `shardable_static` is memory (a frozen ref copy) that FSDP would split over k cards;
    `shard`: FSDP over the k cards on every rung (see `_ladder`)."""
    cap = math.ceil(w.sequences / k)
    want = min(cap, math.ceil(EFFICIENT_TOKENS / w.seq_len))

    def budget(s: TrainerKnobs) -> float:
        return card.memory_bytes - extra_static - shardable_static / s.fsdp_shards

    def peak(s: TrainerKnobs, m: int) -> float:
        return trainer_memory(shape, method, w, s.model_copy(update={"micro_batch": m})).peak_bytes

    ladder = _ladder(method, card, k, shard)
    best: tuple[TrainerKnobs, int] | None = None
    for s in ladder:
        m = largest_micro_batch(lambda m, s=s: peak(s, m) <= budget(s), cap)
        if m >= want:
            best = (s, m)
            break
        if m >= 1 and best is None:
            best = (s, m)
    # The leanest rung: least memory short of its budget (the savers' order is not the same on every card count).
    lean = min(ladder, key=lambda s: peak(s, 1) - budget(s)).model_copy(update={"micro_batch": 1})
    min_peak = peak(lean, 1)
    # Past ~EFFICIENT_TOKENS per micro-batch speed barely improves, so leave the memory free
    # (for vLLM when colocated, for a ref beside the trainer otherwise).
    chosen = (best[0].model_copy(update={"micro_batch": min(best[1], want)})) if best else lean
    mem = trainer_memory(shape, method, w, chosen)
    notes = [] if best else [f"does not fit even with every saver on: needs {min_peak / GB:.1f} GB per card"]
    if chosen.fsdp_shards > 1:
        notes.append(f"FSDP over {k} cards: weights, grads and optimizer states sharded")
    elif k > 1:
        notes.append(f"DDP over {k} cards: each holds the whole model")
    plan = RolePlan(
        role="trainer",
        card=card.name,
        count=k,
        fits=best is not None,
        peak_gb=mem.peak_bytes / GB,
        capacity_gb=budget(chosen) / GB,
        headroom_gb=(budget(chosen) - mem.peak_bytes) / GB,
        micro_batch=chosen.micro_batch if best else 0,
        max_micro_batch=best[1] if best else 0,
        recommended=vocabulary.trainer_settings(chosen, w),
        min_settings=vocabulary.trainer_settings(lean, w),
        layout=vocabulary.trainer_layout(k),
        min_layout=vocabulary.trainer_layout(k),
        min_peak_gb=min_peak / GB,
        peak_phase=mem.peak_phase,
        time_s=trainer_time(shape, method, w, chosen, card, eff, world=k),
        notes=notes,
    )
    plan._settings = chosen
    return plan


def rollout_time(
    shape: ModelShape,
    w: Workload,
    s: ServeSettings,
    card: Card,
    tp: int,
    conc: int,
    eff: Efficiency,
) -> float:
    """One replica generating all `w.sequences`: prefill (compute-bound) + decode (bandwidth-bound)."""
    n = shape.linear_params + shape.vocab_size * shape.hidden_size
    flops = tp * card.fp16_tflops * 1e12 * eff.mfu
    bw = tp * card.bandwidth_gbs * 1e9 * eff.bw_eff
    prompts = w.batch if s.prefix_caching else w.sequences
    prefill = 2 * n * prompts * w.prompt_len / flops
    kv_tok = shape.kv_bytes_per_token(1 if s.kv_dtype == "fp8" else 2)
    waves = math.ceil(w.sequences / max(conc, 1))
    per_token = max(
        (serve_weight_bytes(shape, s.weights) + conc * (w.prompt_len + w.completion_len / 2) * kv_tok) / bw,
        2 * n * conc / flops,
    )
    return prefill + waves * w.completion_len * per_token


def _engine(card: Card, local: str = "inprocess") -> str:
    """gfx906 cards (no bf16) serve through the community vLLM fork's container: the rollout
    and ref services are its clients (engine = remote)."""
    return "remote" if card.bf16_tflops == 0 else local


def _share(gb: float, card: Card, up: bool) -> float:
    """A memory share of the card as vLLM's gpu_memory_utilization (2 decimals, within (0, 1])."""
    x = round(gb / card.memory_gb * 100, 6)  # 0.9 x 141 / 141 must stay 0.90, not 0.89
    return min(1.0, max(0.01, (math.ceil(x) if up else math.floor(x)) / 100))


def plan_rollout(
    shape: ModelShape,
    w: Workload,
    card: Card,
    count: int,
    eff: Efficiency,
    weights: str | None,
    budget_gb: float | None = None,
) -> RolePlan:
    """vLLM replicas over `count` cards of one type; tensor-parallel only if one card is too small."""
    budget = budget_gb * GB if budget_gb is not None else card.memory_bytes
    native = shape.quant_method if shape.quant_method in ("gptq", "awq") else None
    fp = card.serve_dtype
    choices = [weights] if weights else ([native] if native else [fp, "awq"])
    want = min(w.sequences, 64)  # enough sequences in flight to hide the weight reads
    result = None
    for tp in (t for t in (1, 2, 4, 8) if t <= count):
        for q in choices:
            s = ServeSettings(weights=q, kv_dtype="fp16" if fp == "fp16" else "bf16")
            mem = rollout_memory(shape, w, s, max(budget, 0.0) * tp)
            conc = rollout_concurrency(shape, w, s, mem)
            fits = mem.components["kv_cache"] >= kv_bytes_per_group(shape, w, s)
            if fits and (result is None or (conc >= want and result[2] < want)):
                result = (tp, s, conc, mem)
            if fits and conc >= want:
                break
        if result is not None:
            break
    if result is None:
        s = ServeSettings(weights=choices[-1], kv_dtype="fp16" if fp == "fp16" else "bf16")
        mem = rollout_memory(shape, w, s, max(budget, 0.0))
        need = mem.peak_bytes / GB
        settings = vocabulary.rollout_settings(s, 1, _share(need, card, up=True), fp)
        return RolePlan(
            role="rollout",
            card=card.name,
            count=count,
            fits=False,
            peak_gb=need,
            capacity_gb=budget / GB,
            headroom_gb=(budget - mem.peak_bytes) / GB,
            micro_batch=0,
            max_micro_batch=0,
            recommended=settings,
            min_settings=settings | {"max_num_seqs": w.group_size},
            layout={"weights": s.weights, "replicas": 0, "engine": _engine(card)},
            min_layout={"weights": "awq", "replicas": 0, "engine": _engine(card)},
            min_peak_gb=need,
            time_s=math.inf,
            notes=["weights + one group's KV cache do not fit, even 4-bit"],
        )
    tp, s, conc, mem = result
    replicas = count // tp
    t = rollout_time(shape, w, s, card, tp, conc, eff) / replicas
    lean = s.model_copy(update={"weights": "awq", "max_num_seqs": w.group_size})
    lean_mem = rollout_memory(shape, w, lean, budget * tp)
    used = mem.components["weights"] + mem.components["activations"] + mem.components["overhead"]
    min_peak = (lean_mem.peak_bytes - lean_mem.components["kv_cache"] + kv_bytes_per_group(shape, w, lean)) / GB / tp
    return RolePlan(
        role="rollout",
        card=card.name,
        count=count,
        fits=True,
        peak_gb=mem.peak_bytes / GB / tp,
        capacity_gb=budget / GB,
        headroom_gb=(budget - mem.peak_bytes / tp) / GB,
        micro_batch=conc,
        max_micro_batch=conc,
        # vLLM takes utilization x the whole card, so the planner's budget becomes that share.
        recommended=vocabulary.rollout_settings(
            s, tp, _share(s.gpu_memory_utilization * budget / GB, card, up=False), fp
        ),
        min_settings=vocabulary.rollout_settings(lean, tp, _share(min_peak, card, up=True), fp),
        layout={"weights": s.weights, "replicas": replicas, "engine": _engine(card)},
        min_layout={"weights": "awq", "replicas": replicas, "engine": _engine(card)},
        min_peak_gb=min_peak,
        peak_phase="serving",
        time_s=t,
        notes=[f"{(mem.components['kv_cache']) / GB:.1f} GB KV pool beside {used / GB:.1f} GB weights+workspace"],
    )


def plan_ref(
    shape: ModelShape,
    w: Workload,
    card: Card,
    budget_gb: float,
    eff: Efficiency,
    share: bool,
) -> RolePlan:
    """Forward-only reference log-probs in `budget_gb` of one card."""
    budget = budget_gb * GB
    cap = min(w.sequences, max(1, EFFICIENT_TOKENS // w.seq_len))
    m = largest_micro_batch(lambda m: ref_memory(shape, w, m, share_weights=share).peak_bytes <= budget, cap)
    mem = ref_memory(shape, w, max(m, 1), share_weights=share)
    flops = card.tflops * 1e12 * eff.mfu
    t = w.sequences * w.seq_len * shape.forward_flops_per_token(w.seq_len) / flops
    lean = ref_memory(shape, w, 1, share_weights=share, logits_chunk=LOGITS_CHUNK).peak_bytes
    layout = {"weights": card.serve_dtype, "shares_trainer_weights": share, "engine": _engine(card, "hf")}
    return RolePlan(
        role="ref",
        card=card.name,
        count=1,
        fits=m >= 1,
        peak_gb=mem.peak_bytes / GB,
        capacity_gb=budget_gb,
        headroom_gb=(budget - mem.peak_bytes) / GB,
        micro_batch=m,
        max_micro_batch=m,
        recommended=vocabulary.ref_settings(m, w, card.serve_dtype, 0),
        min_settings=vocabulary.ref_settings(1, w, card.serve_dtype, LOGITS_CHUNK),
        layout=layout,
        min_layout=layout,
        min_peak_gb=lean / GB,
        peak_phase="forward",
        time_s=t,
    )
