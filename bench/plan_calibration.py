"""Calibrate the planner's trainer memory model against real training steps on CPU.

Each case builds a random-init Qwen2 model (tiny/small configs, no download), runs GRPO-style
steps (forward over prompt+completion, fp32 log-softmax on completion positions, clipped-ratio
loss, backward, AdamW) in a fresh subprocess, and records the peak of live allocator bytes.
`services.plan.memory.trainer_memory` predicts the same number; the table of both and the error
goes to bench/results/plan_calibration.md.

How peak memory is measured, and why this way: torch's profiler with `profile_memory=True`
sees every allocation and free made through c10's CPU allocator (all tensor storage, including
autograd's saved tensors and kernel scratch tensors) and reports the running total of live
bytes at each event; the max of that total is the step's exact peak of tensor memory. RSS is
reported too but only as a cross-check: glibc keeps freed pages, touches pages lazily and
counts library buffers, so an RSS delta over- or under-states tensor bytes by tens of MB and
varies run to run. On a GPU the planner adds context/workspace overhead and allocator slack on
top of the tensor bytes (see docs/plan.md); those are not what this script measures.

Usage:
    .venv/bin/python bench/plan_calibration.py            # all cases -> bench/results/plan_calibration.md
    .venv/bin/python bench/plan_calibration.py --case '{"config": "tiny", ...}'   # one, JSON out
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.plan.memory import Method, TrainerKnobs, Workload, trainer_memory  # noqa: E402
from services.plan.model_shape import ModelShape, shape_from_config  # noqa: E402
from tests.support.lab.memory import allocations, run_fresh  # noqa: E402
from tests.support.lab.results import RESULTS  # noqa: E402

# Random-init Qwen2 shapes: "tiny" keeps a CI test fast; "small" has a realistic ratio of
# vocab to hidden (the log-prob tensors matter) and enough layers for activations to dominate.
CONFIGS: dict[str, dict[str, int]] = {
    "tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 192,
        "vocab_size": 4096,
    },
    "small": {
        "num_hidden_layers": 6,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
        "vocab_size": 16384,
    },
}


class Case(BaseModel):
    """One measured configuration."""

    config: str = "tiny"
    method: str = "lora"
    rank: int = 8
    dtype: str = "fp32"
    micro_batch: int = 4
    accum: int = 1  # micro-batches per optimizer step
    prompt_len: int = 64
    completion_len: int = 64
    grad_checkpointing: bool = False
    optimizer: str = "adamw"  # adamw (torch, fused) | adamw8bit (bitsandbytes, as the trainer builds it)
    base_bits: int = 16  # LoRA: 4 = NF4 frozen base, loaded as the trainer loads it


def case_shape(case: Case) -> ModelShape:
    c = CONFIGS[case.config]
    return shape_from_config({**c, "model_type": "qwen2", "tie_word_embeddings": True}, f"qwen2-{case.config}")


def estimate(case: Case) -> float:
    """The planner's number for this case: tensor bytes only (no GPU context, no slack)."""
    settings = TrainerKnobs(
        dtype=case.dtype,  # type: ignore[arg-type]
        micro_batch=case.micro_batch,
        gradient_checkpointing=case.grad_checkpointing,
        grad_accumulation=case.accum > 1,
        optimizer_impl="fused",
        optimizer=case.optimizer,  # type: ignore[arg-type]
        base_bits=case.base_bits,  # type: ignore[arg-type]
        master_weights=False,  # the model is cast to the dtype: pure 16-bit, AdamW states follow it
        overhead_gb=0.0,
        fragmentation=0.0,
    )
    workload = Workload(
        prompt_len=case.prompt_len,
        completion_len=case.completion_len,
        group_size=1,
        batch=1,
    )
    method = Method(kind=case.method, rank=case.rank)  # type: ignore[arg-type]
    return trainer_memory(case_shape(case), method, workload, settings).peak_bytes


def measure(case: Case) -> dict[str, float]:
    """Run two optimizer steps under the memory profiler; return peak live tensor bytes."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.dtype]
    m, P, C = case.micro_batch, case.prompt_len, case.completion_len
    cfg = Qwen2Config(**CONFIGS[case.config], tie_word_embeddings=True, attn_implementation="sdpa")
    if case.base_bits == 4:
        # The trainer quantizes while loading from a directory (services/trainer/policy.py).
        saved = tempfile.mkdtemp(prefix="burstrl-calib-")
        Qwen2ForCausalLM(cfg).save_pretrained(saved)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    marker_bytes = 777_777  # a distinctive allocation marks where training starts
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if case.base_bits == 4:
            from transformers import AutoModelForCausalLM

            from services.trainer.quant import keep_trainable_layout, nf4_load_kwargs

            model = AutoModelForCausalLM.from_pretrained(saved, dtype=dtype, **nf4_load_kwargs(dtype, "cpu"))
            keep_trainable_layout(model)
            # from_pretrained leaves the weights it does not convert (embeddings, norms) as views of
            # the mmap'd safetensors file, which the profiler's allocator events never see: copy them
            # into allocator memory, as they are on a GPU and in the 16-bit cases.
            for t in [*model.parameters(), *model.buffers()]:
                if t.dtype != torch.uint8:
                    t.data = t.data.clone()
        else:
            model = Qwen2ForCausalLM(cfg).to(dtype)
        if case.method == "lora":
            from peft import LoraConfig, get_peft_model

            targets = [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            model = get_peft_model(
                model,
                LoraConfig(r=case.rank, lora_alpha=2 * case.rank, target_modules=targets),
            )
        if case.grad_checkpointing:
            model.gradient_checkpointing_enable()
            if case.method == "lora":
                model.enable_input_require_grads()
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        if case.optimizer == "adamw8bit":
            from services.trainer.optim import build_optimizer

            opt = build_optimizer(params, "adamw8bit", lr=1e-5)
        else:
            opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
        batches = [torch.randint(0, cfg.vocab_size, (m, P + C)) for _ in range(case.accum)]
        adv = torch.randn(m, 1)
        marker = torch.empty(marker_bytes, dtype=torch.uint8)
        del marker
        for _ in range(2):
            for ids in batches:
                logits = model(input_ids=ids, logits_to_keep=C + 1).logits[:, :-1]  # [m, C, V]
                logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, P:, None]).squeeze(-1)
                del logits
                ratio = torch.exp(logp - logp.detach())  # GRPO ratio; old log-probs = sampler's
                loss = -(torch.clamp(ratio, 0.8, 1.2) * adv).mean() / case.accum
                loss.backward()
                del logp, ratio, loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    allocs = allocations(prof)
    start = next(i for i, e in enumerate(allocs) if e.extra_fields.alloc_size == marker_bytes)
    peak = max(e.extra_fields.total_allocated for e in allocs[start:])
    setup = allocs[start].extra_fields.total_allocated - marker_bytes  # model + optimizer + inputs
    return {
        "measured": float(peak),
        "setup": float(setup),
        "rss_delta": float(rss1 - rss0),
    }


def run_case(case: Case, timeout: float = 600) -> dict[str, float]:
    """Measure `case` in a fresh interpreter so nothing from other cases is alive or cached."""
    return run_fresh(__file__, case, timeout)


def default_cases() -> list[Case]:
    return [
        Case(config="tiny", method="lora"),
        Case(config="tiny", method="full"),
        Case(config="small", method="lora"),
        Case(config="small", method="lora", grad_checkpointing=True),
        Case(config="small", method="lora", dtype="bf16"),
        Case(config="small", method="lora", dtype="bf16", grad_checkpointing=True),
        Case(config="small", method="full"),
        Case(config="small", method="full", accum=2),
        Case(config="small", method="full", grad_checkpointing=True, accum=2),
        Case(config="small", method="full", dtype="bf16", accum=2),
        Case(
            config="small",
            method="lora",
            micro_batch=8,
            prompt_len=128,
            completion_len=128,
        ),
        # The quantized savers (services/trainer/quant.py): 8-bit AdamW states, an NF4 base.
        Case(config="small", method="full", optimizer="adamw8bit"),
        Case(config="small", method="full", dtype="bf16", accum=2, optimizer="adamw8bit"),
        Case(config="small", method="lora", rank=16, optimizer="adamw8bit"),
        Case(config="small", method="lora", base_bits=4),
        Case(config="small", method="lora", dtype="bf16", base_bits=4),
        Case(config="small", method="lora", base_bits=4, grad_checkpointing=True),
        Case(config="small", method="lora", rank=16, dtype="bf16", base_bits=4, optimizer="adamw8bit"),
    ]


def write_report(rows: list[tuple[Case, dict[str, float]]], path: Path, command: str) -> float:
    """Markdown table of estimate vs measured; returns the worst relative error."""
    mb = 1 / 2**20
    lines = [
        "# Planner calibration: trainer memory, estimate vs measured",
        "",
        f"Produced by `{command}` (torch CPU, random-init Qwen2, 2 GRPO steps per case, fresh process each).",
        "Measured = peak live tensor bytes from torch's memory profiler (allocator events); RSS delta (which also",
        "holds profiler buffers and lazily imported modules) is a cross-check only. Estimate = `services.plan.memory.trainer_memory` with GPU overheads set to zero.",
        "",
        "| config | method | dtype | micro-batch x tokens | accum | ckpt | optimizer | base bits | estimate MiB "
        "| measured MiB | error | RSS delta MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for case, r in rows:
        err = (r["estimate"] - r["measured"]) / r["measured"]
        worst = max(worst, abs(err))
        lines.append(
            f"| {case.config} | {case.method}{'-r' + str(case.rank) if case.method == 'lora' else ''} | {case.dtype} "
            f"| {case.micro_batch} x {case.prompt_len + case.completion_len} | {case.accum} "
            f"| {'on' if case.grad_checkpointing else 'off'} | {case.optimizer} | {case.base_bits} "
            f"| {r['estimate'] * mb:.1f} | {r['measured'] * mb:.1f} "
            f"| {err:+.1%} | {r['rss_delta'] * mb:.0f} |"
        )
    lines += [
        "",
        f"Largest absolute error: **{worst:.1%}** (tests assert the stated tolerance, see docs/plan.md).",
    ]
    # Other benches own parts of this page: marked sections (kept_sections, e.g.
    # bench/chunked_logprobs.py) and bench/gpu_check.py's GPU section at the end. Keep both.
    gpu = "## GPU (CUDA, bf16)"
    old = path.read_text() if path.exists() else ""
    tail = ("\n" + gpu + old.split(gpu, 1)[1]) if gpu in old else ""
    tail = re.sub(r"\n?<!-- ([\w-]+):begin -->.*?<!-- \1:end -->\n?", "\n", tail, flags=re.S)
    path.write_text("\n".join(lines) + "\n" + kept_sections(path) + tail)
    return worst


def kept_sections(path: Path) -> str:
    """Sections other benches write into the page (between `<!-- name:begin -->` and
    `<!-- name:end -->`, e.g. bench/chunked_logprobs.py): kept when this table is rewritten."""
    text = path.read_text() if path.exists() else ""
    found = re.finditer(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->\n?", text, flags=re.S)
    return "".join("\n" + m.group(0) for m in found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help="JSON of one Case: measure it here and print JSON")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_calibration.md")
    args = parser.parse_args(argv)
    if args.case:
        case = Case.model_validate_json(args.case)
        print(json.dumps(measure(case) | {"estimate": estimate(case)}))  # the planner's beside it
        return 0
    rows = []
    for case in default_cases():
        t0 = time.time()
        r = run_case(case) | {"estimate": estimate(case)}
        print(f"{case.model_dump()} -> {r} ({time.time() - t0:.0f}s)", file=sys.stderr)
        rows.append((case, r))
    worst = write_report(rows, args.out, ".venv/bin/python bench/plan_calibration.py")
    print(f"wrote {args.out}; worst error {worst:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
