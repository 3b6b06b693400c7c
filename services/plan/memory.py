"""Memory per role, as pure math over a `ModelShape`: no torch, no cards, no I/O.

`placement.py` calls these functions with settings for each candidate card and compares
`RoleMemory.peak_bytes` with the card's memory; `bench/plan_calibration.py` checks
`trainer_memory` against peak allocator bytes of real training steps.

Trainer activations are counted tensor by tensor from what autograd saves in HF's Llama/Qwen2
decoder layer with SDPA/flash attention (no padding mask, so no [T, T] scores and no repeated
KV heads) and PEFT LoRA. The peak is the largest of a few phases of one step (end of forward,
log-softmax backward, lm_head backward, layer backward, optimizer step), because the big items
- saved activations, the [tokens, vocab] log-prob tensors, gradients - are alive at different times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field

from services.plan.model_shape import ModelShape

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Bytes per weight when served/stored quantized. GPTQ/AWQ: 4-bit weights plus one fp16 scale
# and a 4-bit zero per group of 128; int8/fp8: one byte plus per-channel scales (negligible).
WEIGHT_BYTES = {
    "bf16": 2.0,
    "fp16": 2.0,
    "fp32": 4.0,
    "int8": 1.0,
    "fp8": 1.0,
    "gptq": 0.5 + 2.5 / 128,
    "awq": 0.5 + 2.5 / 128,
}


class Method(BaseModel):
    """What the trainer updates."""

    kind: Literal["lora", "full"] = "lora"
    rank: int = Field(default=16, gt=0, description="LoRA rank (ignored for full).")
    targets: list[str] | None = Field(default=None, description="LoRA target linears; None = all seven.")


class Workload(BaseModel):
    """One GRPO optimizer step: `batch` prompts, `group_size` completions each."""

    prompt_len: int = Field(gt=0)
    completion_len: int = Field(gt=0)
    group_size: int = Field(gt=0)
    batch: int = Field(gt=0, description="Prompts (groups) per optimizer step.")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def sequences(self) -> int:
        return self.batch * self.group_size


class TrainerKnobs(BaseModel):
    """Knobs that trade memory for speed in the trainer. Defaults are the fast, memory-hungry end."""

    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    micro_batch: int = Field(default=1, gt=0, description="Sequences per forward/backward on one card.")
    gradient_checkpointing: bool = False
    logits_chunk: int | None = Field(default=None, description="Tokens per chunked log-prob pass; None = all.")
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    optimizer_impl: Literal["fused", "foreach"] = Field(
        default="fused",
        description="foreach AdamW keeps one extra fp32 temp per trainable weight.",
    )
    master_weights: bool = Field(default=True, description="Full FT: fp32 params/grads under 16-bit compute.")
    cpu_offload: bool = Field(
        default=False,
        description="Full FT: master weights + optimizer states in host RAM.",
    )
    base_bits: Literal[4, 16] = Field(default=16, description="LoRA: 4 = QLoRA (NF4 frozen base).")
    adapter_fp32: bool = Field(default=True, description="PEFT upcasts adapters (and their inputs) to fp32.")
    fsdp_shards: int = Field(default=1, gt=0, description="Cards that shard weights, grads and states.")
    grad_accumulation: bool = Field(default=True, description="Several micro-batches per step: grads stay alive.")
    overhead_gb: float = Field(default=1.0, ge=0, description="CUDA/HIP context, cuBLAS/NCCL workspaces.")
    fragmentation: float = Field(default=0.05, ge=0, description="Caching-allocator slack on dynamic memory.")


class RoleMemory(BaseModel):
    """Bytes on one card of a role's group: persistent components and the peak per phase."""

    role: str
    components: dict[str, float] = Field(description="Persistent bytes by item.")
    phases: dict[str, float] = Field(description="Total bytes (components included) at each phase.")

    @property
    def peak_bytes(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def full_bytes_per_param(s: TrainerKnobs) -> tuple[float, float, float]:
    """Full FT bytes per weight on the card: (params, grads, optimizer states).

    Master-weight mixed precision keeps fp32 params and grads (ZeRO's 16 B/param with Adam);
    pure 16-bit keeps everything in 16 bit, torch's AdamW then keeps m and v in 16 bit too.
    CPU offload (ZeRO-Offload) leaves only 16-bit params and grads on the card.
    """
    a = DTYPE_BYTES[s.dtype]
    if s.cpu_offload:
        return a, a, 0.0
    p = 4.0 if s.master_weights else a
    return p, p, 2.0 if s.optimizer == "adamw8bit" else 2 * p


def trainer_components(shape: ModelShape, method: Method, s: TrainerKnobs) -> dict[str, float]:
    """Persistent bytes per card: weights, optimizer states, and grads when they outlive a micro-batch."""
    a, k = DTYPE_BYTES[s.dtype], s.fsdp_shards
    out: dict[str, float] = {}
    if method.kind == "full":
        n = shape.n_params
        p, g, st = full_bytes_per_param(s)
        out["weights"] = n * p / k
        if p > a:
            # 16-bit copies the matmuls use: autocast keeps all of them until backward; FSDP
            # only gathers ~2 layers (current + prefetch) at a time.
            layer = shape.linear_params / shape.num_layers
            out["compute_copy"] = a * (n if k == 1 else 2 * layer)
        out["optimizer"] = n * st / k
        out["grads"] = n * g / k if s.grad_accumulation else 0.0
    else:
        lora = shape.lora_params(method.rank, method.targets)
        adapter = 4 if s.adapter_fp32 else a
        base = shape.linear_params * (WEIGHT_BYTES["awq"] if s.base_bits == 4 else a)
        out["weights"] = (base + (shape.n_params - shape.linear_params) * a) / k
        out["adapter"] = lora * adapter / k
        out["optimizer"] = lora * (2.0 if s.optimizer == "adamw8bit" else 2 * adapter) / k
        out["grads"] = lora * adapter / k if s.grad_accumulation else 0.0
    return out


def saved_per_token_layer(shape: ModelShape, method: Method, s: TrainerKnobs) -> float:
    """Bytes autograd keeps per token per decoder layer (no checkpointing)."""
    a = DTYPE_BYTES[s.dtype]
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    full = method.kind == "full"
    targets = set(method.targets or shape.linear_shapes())
    # The input a linear saves for its weight grad. Full FT: one tensor shared by q/k/v (and by
    # gate/up). LoRA: PEFT casts the input to the fp32 adapter dtype once per module, so each
    # targeted module saves its own copy; frozen base linears save nothing.
    cast = 4 if (s.adapter_fp32 and a < 4) else 0

    def lin_in(dim: int, names: list[str]) -> float:
        if full:
            return a * dim
        hit = [n for n in names if n in targets]
        if not hit:
            return 0.0
        return cast * dim * len(hit) if cast else a * dim

    # RMSNorm upcasts to fp32 and saves that (4h); the weight multiply saves the normalized
    # tensor only when the norm weight trains (full FT).
    norm = 4 * h + (a * h if full else 0) + 4
    attn = lin_in(h, ["q_proj", "k_proj", "v_proj"]) + a * (2 * q + 2 * kv) + 4 * shape.num_heads
    attn += lin_in(q, ["o_proj"])  # SDPA keeps q, k, v, out (+ logsumexp); o_proj its input
    mlp = lin_in(h, ["gate_proj", "up_proj"]) + 3 * a * i + lin_in(i, ["down_proj"])  # silu in, silu out, up out
    lora_mid = 0.0 if full else len(targets) * method.rank * (4 if s.adapter_fp32 else a)
    return 2 * norm + attn + mlp + lora_mid


def trainer_memory(shape: ModelShape, method: Method, w: Workload, s: TrainerKnobs) -> RoleMemory:
    """Peak bytes on one trainer card for one micro-batch of `s.micro_batch` sequences."""
    a, k, V, h = (
        DTYPE_BYTES[s.dtype],
        s.fsdp_shards,
        shape.vocab_size,
        shape.hidden_size,
    )
    full = method.kind == "full"
    comp = trainer_components(shape, method, s)
    static = sum(comp.values())
    n = s.micro_batch * w.seq_len  # tokens through the layers
    n_logit = s.micro_batch * w.completion_len  # only completion positions need log-probs
    if s.logits_chunk:
        n_logit = min(n_logit, s.logits_chunk)
    layer = saved_per_token_layer(shape, method, s)
    final_norm = 4 * h + (2 * a * h if full else 0)  # + normed output kept for lm_head's weight grad
    if s.gradient_checkpointing:
        saved = n * (shape.num_layers * a * h + final_norm)  # only each layer's input
        recompute = n * layer  # one layer re-run during its backward
    else:
        saved = n * (shape.num_layers * layer + final_norm)
        recompute = 0.0
    # log_softmax output, the zero-filled grad from gather, and the grad it produces: 3 fp32 [tokens, V].
    logprob_peak = 3 * 4 * V * n_logit
    grad_bytes = full_bytes_per_param(s)[1] if full else (4 if s.adapter_fp32 else a)
    head_grad = 0.0
    if full and not s.grad_accumulation:
        # lm_head (= embedding when tied) grads appear before any layer's backward runs.
        head_grad = V * h * grad_bytes / k
    layer_bwd_tmp = n * a * (2 * h + 2 * shape.intermediate_size)  # grads of the MLP pair + hidden
    trainable = shape.n_params if full else shape.lora_params(method.rank, method.targets)
    all_grads = 0.0 if s.grad_accumulation else trainable * grad_bytes / k
    opt_tmp = 4 * trainable / k if s.optimizer_impl == "foreach" and not (full and s.cpu_offload) else 0.0
    phases = {
        "forward end": static + saved + 4 * V * n_logit,
        "log-prob backward": static + saved + logprob_peak,
        "lm_head backward": static + saved + 4 * V * n_logit + head_grad,
        "layer backward": static + saved + recompute + layer_bwd_tmp + head_grad,
        "optimizer step": static + all_grads + opt_tmp,
    }
    overhead = s.overhead_gb * GB
    phases = {p: v + overhead + s.fragmentation * (v - static) for p, v in phases.items()}
    comp = {**comp, "activations (peak)": max(phases.values()) - static - overhead}
    return RoleMemory(role="trainer", components=comp, phases=phases)


class ServeSettings(BaseModel):
    """A vLLM engine (rollout) or a forward-only scorer (ref)."""

    weights: str = Field(default="bf16", description="bf16, fp16, int8, fp8, gptq or awq.")
    kv_dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    prefix_caching: bool = Field(default=True, description="A group's G samples share the prompt's KV blocks.")
    overhead_gb: float = Field(default=1.0, ge=0, description="Context, CUDA graphs, LoRA buffers.")
    block_size: int = 16


def serve_weight_bytes(shape: ModelShape, weights: str) -> float:
    """Quantizers (GPTQ/AWQ/int8) leave embeddings, lm_head and norms in 16 bit (fp32 keeps all in fp32)."""
    rest = 4 if weights == "fp32" else 2
    return shape.linear_params * WEIGHT_BYTES[weights] + (shape.n_params - shape.linear_params) * rest


def kv_bytes_per_group(shape: ModelShape, w: Workload, s: ServeSettings) -> float:
    """KV of one prompt and its G completions, in whole blocks."""
    kv_tok = shape.kv_bytes_per_token(1 if s.kv_dtype == "fp8" else 2)
    blocks = _ceil_div(w.prompt_len, s.block_size) * (1 if s.prefix_caching else w.group_size)
    blocks += w.group_size * _ceil_div(w.completion_len + (0 if s.prefix_caching else w.prompt_len), s.block_size)
    return blocks * s.block_size * kv_tok


def rollout_memory(shape: ModelShape, w: Workload, s: ServeSettings, card_bytes: float) -> RoleMemory:
    """vLLM: weights + profiling-run activations + overhead; the rest up to utilization is KV cache."""
    weights = serve_weight_bytes(shape, s.weights)
    # vLLM sizes its KV pool after a dummy forward of max_num_batched_tokens (hidden, qkv,
    # gate_up, act outputs in 16 bit) and a sampler pass over max_num_seqs fp32 logits.
    hq = shape.hidden_size * 2 + shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate_size
    act = s.max_num_batched_tokens * hq * 2 + s.max_num_seqs * shape.vocab_size * 4 * 2
    fixed = weights + act + s.overhead_gb * GB
    kv_pool = max(0.0, s.gpu_memory_utilization * card_bytes - fixed)
    need = kv_bytes_per_group(shape, w, s)  # at least one full group in flight
    comp = {
        "weights": weights,
        "activations": act,
        "overhead": s.overhead_gb * GB,
        "kv_cache": kv_pool,
    }
    # vLLM grabs the whole pool, so the engine "uses" utilization x card; it fits if one group fits.
    return RoleMemory(role="rollout", components=comp, phases={"serving": fixed + max(kv_pool, need)})


def rollout_concurrency(shape: ModelShape, w: Workload, s: ServeSettings, mem: RoleMemory) -> int:
    """Sequences in flight at once: whole groups whose KV fits, capped by max_num_seqs."""
    groups = int(mem.components["kv_cache"] // kv_bytes_per_group(shape, w, s))
    return min(groups * w.group_size, s.max_num_seqs, w.sequences)


def ref_memory(
    shape: ModelShape,
    w: Workload,
    micro_batch: int,
    weights: str = "bf16",
    overhead_gb: float = 1.0,
    share_weights: bool = False,
    logits_chunk: int = 0,
) -> RoleMemory:
    """Forward-only log-probs under the frozen reference, `micro_batch` sequences at a time.

    `share_weights`: LoRA colocated with the trainer, the ref is the trainer's base with the
    adapter disabled, so it costs activations only. `logits_chunk` > 0: log-probs computed
    that many tokens at a time (0: the whole micro-batch at once, the upper bound).
    """
    n, n_logit = micro_batch * w.seq_len, micro_batch * w.completion_len
    if logits_chunk:
        n_logit = min(n_logit, logits_chunk)
    weight = 0.0 if share_weights else serve_weight_bytes(shape, weights)
    # No autograd: only one layer's temporaries live, plus the logits in the compute dtype, their
    # fp32 copy and the log-softmax. fp32 weights (the CPU scorer) compute in fp32: no copy.
    a = 4 if weights == "fp32" else 2
    layer_tmp = n * a * (2 * shape.hidden_size + shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate_size)
    logits = n_logit * shape.vocab_size * (a + (4 if a < 4 else 0) + 4)
    comp = {"weights": weight, "overhead": 0.0 if share_weights else overhead_gb * GB}
    total = sum(comp.values())
    return RoleMemory(role="ref", components=comp, phases={"forward": total + max(layer_tmp, logits)})


def largest_micro_batch(fits: Callable[[int], bool], cap: int) -> int:
    """Largest m in [1, cap] with fits(m) (memory only grows with m); 0 if even 1 does not fit."""
    if not fits(1):
        return 0
    lo, hi = 1, max(1, cap)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
