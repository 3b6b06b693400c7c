"""Placement: which cards run which role, with which settings, and how long a step takes.

`plan()` is the planner's one entry point (the CLI calls it, `report.py` renders its `Plan`).
It tries every way to give the trainer k cards of one type and the rollout/ref the rest
(disaggregated, burstrl's way), and every k cards of one type running all roles (colocated,
vLLM and training sharing memory, as most frameworks do), sizes each role with `memory.py`,
and keeps the fastest placement that fits.

Step times are rough by design: FLOPs / (peak x `mfu`) for compute-bound work and bytes /
(bandwidth x `bw_eff`) for decode, which is bandwidth-bound. Disaggregated roles overlap
(the trainer learns from step N while rollout samples N+1 under the staleness budget), so its
step is the slower side; colocated roles take turns, so its step is the sum.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

from services.plan.catalog import Card
from services.plan.memory import (
    GB,
    Method,
    ServeSettings,
    TrainerSettings,
    Workload,
    kv_bytes_per_group,
    largest_micro_batch,
    ref_memory,
    rollout_concurrency,
    rollout_memory,
    serve_weight_bytes,
    trainer_memory,
)
from services.plan.model_shape import ModelShape

Placement = Literal["disaggregated", "colocated"]
# Tokens per micro-batch that keep matmuls efficient; beyond this a larger micro-batch buys little.
EFFICIENT_TOKENS = 4096


class Efficiency(BaseModel):
    """How much of the data-sheet numbers real code gets."""

    mfu: float = Field(
        default=0.4,
        gt=0,
        le=1,
        description="Fraction of peak FLOPS in matmul-bound work.",
    )
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
    micro_batch: int = Field(description="Recommended micro-batch (trainer/ref) or sequences in flight (rollout).")
    max_micro_batch: int = Field(description="Largest micro-batch (or sequences in flight) that fits.")
    recommended: dict[str, object]
    min_settings: dict[str, object]
    min_peak_gb: float
    peak_phase: str = ""
    time_s: float = Field(description="Seconds this role spends per optimizer step.")
    notes: list[str] = Field(default_factory=list)


class Plan(BaseModel):
    """The planner's answer; `report.py` renders it, `--json` prints it."""

    model: str
    params_b: float
    method: str
    workload: Workload
    placement: Placement
    fits: bool
    step_time_s: float
    roles: list[RolePlan]
    alternatives: list[dict[str, object]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def _ladder(method: Method, card: Card, k: int) -> list[TrainerSettings]:
    """Trainer settings from fastest to leanest; each rung adds the next-cheapest memory saver."""
    base = TrainerSettings(dtype=card.train_dtype, fsdp_shards=k)  # type: ignore[arg-type]
    rungs = [{}, {"logits_chunk": 1024}, {"grad_checkpointing": True}]
    rungs += [{"optimizer": "adamw8bit"}, {"cpu_offload": True}] if method.kind == "full" else [{"base_bits": 4}]
    out, acc = [], {}
    for rung in rungs:
        acc |= rung
        out.append(base.model_copy(update=acc))
    return out


def _diff(s: TrainerSettings) -> dict[str, object]:
    """Only the settings that differ from the defaults, so the table stays short."""
    default = TrainerSettings()
    return {k: v for k, v in s.model_dump().items() if v != getattr(default, k) or k in ("dtype", "micro_batch")}


def trainer_time(
    shape: ModelShape,
    method: Method,
    w: Workload,
    s: TrainerSettings,
    card: Card,
    eff: Efficiency,
) -> float:
    full, k = method.kind == "full", s.fsdp_shards
    tokens = w.sequences * w.seq_len
    # Forward 1x; backward 2x for full (input and weight grads), ~1x for LoRA (input grads only).
    passes = (3 if full else 2) + (1 if s.grad_checkpointing else 0)
    compute = tokens * shape.forward_flops_per_token(w.seq_len) * passes / (k * card.tflops * 1e12 * eff.mfu)
    compute *= 1.25 if s.base_bits == 4 else 1.0  # QLoRA dequantizes every weight on every use
    weight_bytes = shape.n_params * 2
    comm = 0.0
    if k > 1:  # FSDP: all-gather weights for forward and backward, reduce-scatter grads, per micro-batch
        micro_steps = math.ceil(w.sequences / (k * s.micro_batch))
        per_micro = weight_bytes * (3 if full else 2) * (k - 1) / k
        comm = micro_steps * per_micro / (card.link_gbs * 1e9)
    trainable = shape.n_params if full else shape.lora_params(method.rank, method.targets)
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
) -> RolePlan:
    """Fastest settings that fit on k cards; `extra_static` is memory other roles pin there."""
    budget = card.memory_bytes - extra_static
    cap = math.ceil(w.sequences / k)
    want = min(cap, math.ceil(EFFICIENT_TOKENS / w.seq_len))

    def peak(s: TrainerSettings, m: int) -> float:
        return trainer_memory(shape, method, w, s.model_copy(update={"micro_batch": m})).peak_bytes

    ladder = _ladder(method, card, k)
    best: tuple[TrainerSettings, int] | None = None
    for s in ladder:
        m = largest_micro_batch(lambda m, s=s: peak(s, m) <= budget, cap)
        if m >= want:
            best = (s, m)
            break
        if m >= 1 and best is None:
            best = (s, m)
    lean = ladder[-1].model_copy(update={"micro_batch": 1})
    min_peak = peak(lean, 1)
    # Past ~EFFICIENT_TOKENS per micro-batch speed barely improves, so leave the memory free
    # (for vLLM when colocated, for a ref beside the trainer otherwise).
    chosen = (best[0].model_copy(update={"micro_batch": min(best[1], want)})) if best else lean
    mem = trainer_memory(shape, method, w, chosen)
    notes = [] if best else [f"does not fit even with every saver on: needs {min_peak / GB:.1f} GB per card"]
    return RolePlan(
        role="trainer",
        card=card.name,
        count=k,
        fits=best is not None,
        peak_gb=mem.peak_bytes / GB,
        capacity_gb=budget / GB,
        headroom_gb=(budget - mem.peak_bytes) / GB,
        micro_batch=chosen.micro_batch if best else 0,
        max_micro_batch=best[1] if best else 0,
        recommended=_diff(chosen),
        min_settings=_diff(lean),
        min_peak_gb=min_peak / GB,
        peak_phase=mem.peak_phase,
        time_s=trainer_time(shape, method, w, chosen, card, eff),
        notes=notes,
    )


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
    fp = "bf16" if card.bf16_tflops > 0 else "fp16"
    choices = [weights] if weights else ([native] if native else [fp, "awq"])
    want = min(w.sequences, 64)  # enough sequences in flight to hide the weight reads
    result = None
    for tp in (t for t in (1, 2, 4, 8) if t <= count):
        for q in choices:
            s = ServeSettings(weights=q, kv_dtype="fp16" if fp == "fp16" else "bf16")
            mem = rollout_memory(shape, w, s, budget * tp)
            conc = rollout_concurrency(shape, w, s, mem)
            fits = mem.components["kv_cache"] >= kv_bytes_per_group(shape, w, s)
            if fits and (result is None or (conc >= want and result[2] < want)):
                result = (tp, s, conc, mem)
            if fits and conc >= want:
                break
        if result is not None:
            break
    if result is None:
        s = ServeSettings(weights=choices[-1])
        mem = rollout_memory(shape, w, s, budget)
        need = mem.peak_bytes / GB
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
            recommended={"weights": s.weights},
            min_settings={"weights": "awq"},
            min_peak_gb=need,
            time_s=math.inf,
            notes=["weights + one group's KV cache do not fit, even 4-bit"],
        )
    tp, s, conc, mem = result
    replicas = count // tp
    t = rollout_time(shape, w, s, card, tp, conc, eff) / replicas
    lean = s.model_copy(update={"weights": "awq"})
    lean_mem = rollout_memory(shape, w, lean, budget * tp)
    used = mem.components["weights"] + mem.components["activations"] + mem.components["overhead"]
    rec = {
        "weights": s.weights,
        "kv_dtype": s.kv_dtype,
        "tensor_parallel": tp,
        "replicas": replicas,
        "gpu_memory_utilization": round(s.gpu_memory_utilization * budget / card.memory_bytes, 2),
    }
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
        recommended=rec,
        min_settings={"weights": "awq", "max_num_seqs": w.group_size},
        min_peak_gb=(lean_mem.peak_bytes - lean_mem.components["kv_cache"]) / GB / tp
        + kv_bytes_per_group(shape, w, lean) / GB / tp,
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
    lean = ref_memory(shape, w, 1, share_weights=share).peak_bytes
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
        recommended={"weights": card.train_dtype, "shares_trainer_weights": share},
        min_settings={"micro_batch": 1},
        min_peak_gb=lean / GB,
        peak_phase="forward",
        time_s=t,
    )


def _combine(times: list[float]) -> float:
    """Groups working in parallel on shares proportional to their speed."""
    rate = sum(1 / t for t in times if t > 0 and math.isfinite(t))
    return 1 / rate if rate else math.inf


def _disaggregated(
    shape: ModelShape,
    method: Method,
    w: Workload,
    pool: dict[str, tuple[Card, int]],
    trainer_card: Card,
    k: int,
    ref: bool,
    weights: str | None,
    eff: Efficiency,
) -> Plan:
    trainer = plan_trainer(shape, method, w, trainer_card, k, eff)
    rest = {n: (c, cnt - (k if n == trainer_card.name else 0)) for n, (c, cnt) in pool.items()}
    rest = {n: v for n, v in rest.items() if v[1] > 0}
    base = [plan_rollout(shape, w, c, cnt, eff, weights) for c, cnt in rest.values()]
    # (rollouts, ref, trainer-side seconds, sampling-side seconds) for each place the ref could go.
    options: list[tuple[list[RolePlan], RolePlan | None, float, float]] = []
    if not ref:
        options.append((base, None, trainer.time_s, _combine([r.time_s for r in base if r.fits])))
    elif trainer.fits:  # one ref replica per trainer card, in the trainer's headroom
        r = plan_ref(shape, w, trainer_card, trainer.headroom_gb, eff, share=False)
        r.count, r.time_s = k, r.time_s / k
        r.notes.append("beside the trainer")
        options.append(
            (
                base,
                r,
                trainer.time_s + r.time_s,
                _combine([x.time_s for x in base if x.fits]),
            )
        )
    for i, (card, cnt) in enumerate(rest.values() if ref else []):
        # One ref replica beside each rollout engine of this type; vLLM gets the rest of the card.
        want = max(1, min(w.sequences, EFFICIENT_TOKENS // w.seq_len))
        need_gb = min(ref_memory(shape, w, want).peak_bytes / GB, card.memory_gb)
        r = plan_ref(shape, w, card, need_gb, eff, share=False)
        r.count, r.time_s = cnt, r.time_s / cnt
        r.notes.append(f"beside rollout on each {card.name}")
        rolls = list(base)
        rolls[i] = plan_rollout(shape, w, card, cnt, eff, weights, budget_gb=card.memory_gb - r.peak_gb)
        options.append(
            (
                rolls,
                r,
                trainer.time_s,
                _combine([x.time_s for x in rolls if x.fits]) + r.time_s,
            )
        )
    notes: list[str] = [] if rest else ["no cards left for rollout"]
    if not options:
        options.append((base, None, trainer.time_s, math.inf))

    def score(
        o: tuple[list[RolePlan], RolePlan | None, float, float],
    ) -> tuple[bool, float]:
        ok = any(x.fits for x in o[0]) and (o[1] is None or o[1].fits)
        return (not ok, max(o[2], o[3]))

    rollouts, ref_plan, t_train, t_sample = min(options, key=score)
    roles = [trainer, *rollouts] + ([ref_plan] if ref_plan else [])
    fits = trainer.fits and not score((rollouts, ref_plan, t_train, t_sample))[0]
    step = max(t_train, t_sample)
    return Plan(
        model=shape.name,
        params_b=shape.n_params / 1e9,
        method=_method_str(method),
        workload=w,
        placement="disaggregated",
        fits=fits,
        step_time_s=step,
        roles=roles,
        notes=notes,
    )


def _colocated(
    shape: ModelShape,
    method: Method,
    w: Workload,
    card: Card,
    k: int,
    ref: bool,
    weights: str | None,
    eff: Efficiency,
) -> Plan:
    # vLLM sleep mode: during training vLLM keeps only its context; weights go to host RAM, KV is dropped.
    sleeping = ServeSettings().overhead_gb * GB
    ref_weights = serve_weight_bytes(shape, card.train_dtype) / k if ref and method.kind == "full" else 0.0
    trainer = plan_trainer(shape, method, w, card, k, eff, extra_static=sleeping + ref_weights)
    chosen = TrainerSettings.model_validate(trainer.recommended | {"fsdp_shards": k})
    static = sum(trainer_memory(shape, method, w, chosen).components.values())
    static += chosen.overhead_gb * GB + ref_weights
    rollout = plan_rollout(shape, w, card, k, eff, weights, budget_gb=(card.memory_bytes - static) / GB)
    rollout.notes.append("vLLM in sleep mode while the trainer steps")
    roles = [trainer, rollout]
    t = trainer.time_s + rollout.time_s
    fits = trainer.fits and rollout.fits
    if ref:
        # The ref is the trainer's own model (LoRA: adapter disabled; full: a frozen copy kept beside it).
        ref_plan = plan_ref(shape, w, card, (card.memory_bytes - static) / GB, eff, share=True)
        ref_plan.count, ref_plan.time_s = k, ref_plan.time_s / k
        roles.append(ref_plan)
        t += ref_plan.time_s
        fits = fits and ref_plan.fits
    return Plan(
        model=shape.name,
        params_b=shape.n_params / 1e9,
        method=_method_str(method),
        workload=w,
        placement="colocated",
        fits=fits,
        step_time_s=t,
        roles=roles,
    )


def _method_str(method: Method) -> str:
    return f"lora r={method.rank}" if method.kind == "lora" else "full"


def plan(
    shape: ModelShape,
    method: Method,
    w: Workload,
    cards: list[tuple[Card, int]],
    *,
    placement: Literal["auto", "disaggregated", "colocated"] = "auto",
    ref: bool = True,
    rollout_weights: str | None = None,
    eff: Efficiency | None = None,
) -> Plan:
    """Every candidate placement over `cards`; the fastest that fits, with the runners-up listed."""
    eff = eff or Efficiency()
    pool: dict[str, tuple[Card, int]] = {}
    for card, count in cards:
        pool[card.name] = (card, pool.get(card.name, (card, 0))[1] + count)
    candidates: list[Plan] = []
    for card, count in pool.values():
        for k in range(1, count + 1):
            if placement in ("auto", "disaggregated"):
                candidates.append(_disaggregated(shape, method, w, pool, card, k, ref, rollout_weights, eff))
            if placement in ("auto", "colocated"):
                candidates.append(_colocated(shape, method, w, card, k, ref, rollout_weights, eff))
    if not candidates:
        raise ValueError("no cards given")

    def rank(p: Plan) -> tuple[bool, float, int]:
        return (not p.fits, p.step_time_s, p.roles[0].count)

    candidates.sort(key=rank)
    best = candidates[0]
    best.alternatives = [
        {
            "placement": p.placement,
            "fits": p.fits,
            "step_time_s": p.step_time_s,
            "layout": ", ".join(f"{r.role}: {r.count}x {r.card}" for r in p.roles),
        }
        for p in candidates[1:6]
    ]
    if not best.fits:
        best.notes.append("nothing fits: see each role's min settings and peak, or add cards")
    return best
